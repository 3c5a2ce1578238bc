"""Triton kernels of the paged attention (CUDA; on CPU only under TRITON_INTERPRET=1 in tests).

Import this package only when the Triton path is used: `triton.jit` reads TRITON_INTERPRET when the
kernels are defined, i.e. at import time.
"""

from engine.model.attention.triton_kernels.cache_write import write_kv_cache
from engine.model.attention.triton_kernels.decode_attention import decode_attention
from engine.model.attention.triton_kernels.prefill_attention import prefill_attention

__all__ = ["decode_attention", "prefill_attention", "write_kv_cache"]
