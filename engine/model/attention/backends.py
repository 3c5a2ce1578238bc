"""Which attention backend serves the model, chosen once at load, and `paged_attention`, the one
entry every layer's attention goes through: write the step's new K/V into the block pools, then
attend over each sequence's blocks.

Backends ($MODELYARD_ATTENTION_BACKEND forces one; `select_backend` reads it once, at load):
- "triton" (auto on CUDA): the Triton kernels of `engine.model.attention.triton_kernels`.
- "cpu" (auto on CPU when the C kernels build): the torch reference with the C pieces of
  `engine.model.attention.cpu_backend`: the cache write, and decode groups on the C kernel that
  reads K/V straight from the block pools (fp32 or bf16; other dtypes and prefill groups take the
  torch path).
- "torch" (the reference, and the fallback when no compiler is found):
  `engine.model.attention.torch_reference`.
"""

from __future__ import annotations

import os

import torch

from engine.model.attention import cpu_backend
from engine.model.attention.metadata import AttentionMetadata
from engine.model.attention.torch_reference import attend_torch, write_kv_cache_torch
from engine.model.cpu.kernels.build import available

# "triton" | "cpu" | "torch" | unset (auto: triton on CUDA, cpu on CPU when its kernel builds)
BACKEND_ENV = "MODELYARD_ATTENTION_BACKEND"
BACKENDS = ("triton", "cpu", "torch")


def select_backend(device: torch.device) -> str:
    """The backend for a model on ``device``: $MODELYARD_ATTENTION_BACKEND when set, else Triton on
    CUDA, the C kernels on CPU when they build, torch otherwise. Called once, at load."""
    choice = os.environ.get(BACKEND_ENV)
    if choice:
        return _checked(choice)
    if device.type == "cuda":
        return "triton"
    return "cpu" if device.type == "cpu" and available() else "torch"


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: str,
) -> torch.Tensor:
    """Write key/value at meta.slot_mapping, then attend every sequence over its cached context.

    query [T, Hq, D]; key/value [T, Hkv, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D].
    Causal, GQA (Hq % Hkv == 0), sliding window (query i sees keys j with i - W < j <= i),
    soft-capped scores (softcap * tanh(s / softcap)) when given.
    Returns [T, Hq, D] in query's dtype. ``backend``: one of BACKENDS (see `select_backend`).
    """
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} not a multiple of kv heads {key.shape[1]}")
    if sliding_window is not None and sliding_window <= 0:
        sliding_window = None
    if _checked(backend) == "triton":
        # deferred: importing Triton is slow, and triton.jit reads TRITON_INTERPRET at import
        from engine.model.attention import triton_kernels

        triton_kernels.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        attend = (
            triton_kernels.decode_attention
            if meta.is_decode_only
            else triton_kernels.prefill_attention
        )
        return attend(query, k_cache, v_cache, meta, scale, sliding_window, softcap)
    cpu = backend == "cpu"
    if not (cpu and cpu_backend.write_kv_cache(key, value, k_cache, v_cache, meta)):
        write_kv_cache_torch(key, value, k_cache, v_cache, meta.slot_mapping)
    decode_groups = cpu_backend.decode_kernel(query, k_cache) if cpu else None
    return attend_torch(
        query, k_cache, v_cache, meta, scale, sliding_window, softcap, decode_groups=decode_groups
    )


def _checked(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}: expected 'triton', 'cpu' or 'torch'"
        )
    return backend
