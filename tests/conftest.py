"""Test-session setup that must happen before anything imports Triton."""

import os

import torch

# Without a GPU, Triton kernels run only in Triton's interpreter, which must be switched on before
# triton is first imported: then the registry tests cover `flash_triton` like every other implementation.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
