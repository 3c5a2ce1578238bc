"""The "cpu" attention backend: decode groups through the C kernel, which reads K/V in place from
the block pools (fp32 or bf16); prefill groups and other dtypes take the torch reference. For
decode-only steps, `fused_decode_step` also folds each layer's rotary and cache write (and, from
the lean forward, its qkv GEMM) into the kernel's one call.
"""

from __future__ import annotations

import torch

from engine.model.attention.metadata import AttentionMetadata
from engine.model.attention.torch_reference import (
    AttentionGroup,
    attend_torch,
    write_kv_cache_torch,
)
from engine.model.cpu.kernels import paged_decode
from engine.model.cpu.kernels.build import available
from engine.model.cpu.threads import all_threads, threads_for

# The C decode kernel runs multi-threaded from this many visible-key x query-head x head-dim
# multiply-adds (per pass over K or V): about where two threads begin to beat one once the wake-up
# is paid. A lone sequence splits only by KV head (3 tasks for SmolLM2), too few to amortise the
# wake-up even at long contexts (figures: docs/PERFORMANCE.md#thread-wake-ups).
_KERNEL_PARALLEL_MACS = 1e6


def paged_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """`engine.model.attention.backends.paged_attention` on the C kernels where they serve these
    tensors (the cache write too), on the torch reference where they do not."""
    written = slots_in_range(meta, k_cache) and paged_decode.write_kv_cache(
        key, value, k_cache, v_cache, meta.slot_mapping
    )
    if not written:
        write_kv_cache_torch(key, value, k_cache, v_cache, meta.slot_mapping)
    kernel = paged_decode.supports(query, k_cache) and available()
    return attend_torch(
        query, k_cache, v_cache, meta, scale, sliding_window, softcap,
        decode_groups=_attend_decode_kernel if kernel else None,
    )  # fmt: skip


def slots_in_range(meta: AttentionMetadata, k_cache: torch.Tensor) -> bool:
    """Whether every slot of the step lies inside the pools (checked once per step): the C
    kernels write K/V without bounds checks."""
    in_range = meta.derived.get("slots_in_range")
    if in_range is None:
        slots = meta.slot_mapping
        capacity = k_cache.shape[0] * k_cache.shape[1]
        in_range = meta.derived["slots_in_range"] = bool(
            slots.numel() and int(slots.min()) >= 0 and int(slots.max()) < capacity
        )
    return in_range


def _attend_decode_kernel(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """A decode group through the fused C kernel: no gather, K/V read in place from the pools."""
    key = ("kernel_inputs", sliding_window)
    inputs = group.derived.get(key)
    if inputs is None:
        tables, seq_lens = meta.block_tables, meta.seq_lens
        if group.seq_ids is not None:
            tables, seq_lens = tables[group.seq_ids], seq_lens[group.seq_ids]
        visible = sum(min(s, sliding_window or s) for s in group.seq_lens)
        inputs = group.derived[key] = (
            tables.contiguous(),
            seq_lens.contiguous(),
            visible * query.shape[1] * query.shape[2],
        )
    tables, seq_lens, macs = inputs
    q = query if group.rows is None else query.index_select(0, group.rows)
    return paged_decode.paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, scale, sliding_window, softcap, _kernel_threads(macs)
    )


def _kernel_threads(macs: int) -> int:
    """Threads of a C decode kernel call of ``macs`` multiply-adds per pass: inside split_threads
    its count for big enough work, else 1; outside, torch's own count for big enough work."""
    if all_threads():
        return max(1, threads_for(macs, _KERNEL_PARALLEL_MACS))
    return torch.get_num_threads() if macs >= _KERNEL_PARALLEL_MACS else 1


def fused_decode_step(
    meta: AttentionMetadata,
    k_cache: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    q_heads: int,
    dtype: torch.dtype,
    time_projection: bool = False,
) -> paged_decode.DecodeStep | None:
    """A decode-only step's per-layer rotary + cache write + attention as one C call each, for a
    step of the "cpu" backend (the caller checks that it is the backend in use) where the kernel
    serves it (fp32 or bf16 activations and CPU pools, every slot inside the pools); None: the
    caller rotates q/k and calls `paged_attention`.

    rotary: cos/sin [B, head_dim] of the step's tokens (rotate-half convention, as
    engine.model.cpu.kernels.fused_ops.FusedOps.rope takes them). time_projection: the calls that
    run the qkv projection also time it (DecodeStep.projection_s), for the step profile."""
    if (
        not meta.is_decode_only
        or dtype not in (torch.float32, torch.bfloat16)
        or k_cache.device.type != "cpu"
        or k_cache.dtype not in (torch.float32, torch.bfloat16)
        or not available()
        or not slots_in_range(meta, k_cache)
    ):
        return None
    _, block_size, kv_heads, head_dim = k_cache.shape
    visible = sum(meta.seq_lens_cpu)  # sizes the thread count; a sliding window only shrinks it
    return paged_decode.DecodeStep(
        meta.block_tables,
        meta.seq_lens,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        kv_dtype=k_cache.dtype,
        num_threads=_kernel_threads(visible * q_heads * head_dim),
        act_dtype=dtype,
        slots=meta.slot_mapping,
        rotary=rotary,
        time_projection=time_projection,
    )
