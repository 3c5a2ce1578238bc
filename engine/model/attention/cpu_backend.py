"""The C pieces of the "cpu" attention backend, which otherwise runs the torch reference: the
step's K/V written into the block pools by one C call each, and decode groups attended by the C
kernel, which reads K/V in place from the pools (fp32 or bf16). The lean forward's decode-only
steps fold rotary, cache write and attention into one kernel call instead
(engine.model.cpu.fused_decode).
"""

from __future__ import annotations

import torch

from engine.model.attention.metadata import AttentionMetadata
from engine.model.attention.torch_reference import AttentionGroup, GroupAttention
from engine.model.cpu.kernels import paged_decode
from engine.model.cpu.kernels.build import available


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> bool:
    """Copy key/value [T, Hkv, D] into their slots (meta.slot_mapping) with one C call each;
    False, nothing written, where the kernel does not serve these tensors or a slot lies outside
    the pools (the C copy checks no bounds): the caller writes with torch."""
    capacity = k_cache.shape[0] * k_cache.shape[1]
    return meta.slots_within(capacity) and paged_decode.write_kv_cache(
        key, value, k_cache, v_cache, meta.slot_mapping
    )


def decode_kernel(query: torch.Tensor, k_cache: torch.Tensor) -> GroupAttention | None:
    """The C kernel as `attend_torch`'s decode_groups, where it serves these tensors."""
    return _attend_decode_kernel if paged_decode.supports(query, k_cache) and available() else None


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
        q, k_cache, v_cache, tables, seq_lens, scale, sliding_window, softcap,
        paged_decode.decode_threads(macs),
    )  # fmt: skip
