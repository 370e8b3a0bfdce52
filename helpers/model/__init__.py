"""The GPT: its configuration, the model and its forward pass, attention and its kernels.

Also FlashAttention from scratch in PyTorch and Triton, the decoding rules, and GPT-2 weights in the
Hugging Face layout.
"""

from . import moe as moe  # registers ffn_type="moe" before any config names it
