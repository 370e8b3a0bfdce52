"""Inference: the KV cache, int8 quantization, the paged KV cache and the serving engine."""
