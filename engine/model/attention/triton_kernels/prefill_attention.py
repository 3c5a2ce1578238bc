"""Triton kernel: attention for a flattened batch of prefill chunks (and decodes) over paged K/V.

One program per (sequence, query head, BLOCK_M-row query tile). A sequence's new tokens sit at the
end of its context (positions seq_len - q_len .. seq_len - 1) and every key, cached or new, is read
from the paged cache, so a chunked prefill over a cached prefix needs no special case. Key tiles
outside the causal / sliding-window band of the query tile are skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from engine.model.attention.triton_kernels.common import (
    INTERPRETED,
    check_attention_inputs,
    dot_precision,
    load_kv_tile,
    online_softmax_update,
    padded_dim,
    tile_scores,
)

if TYPE_CHECKING:
    from engine.model.attention.metadata import AttentionMetadata


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale,
    softcap,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    Q_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid covers the longest query; shorter ones stop here
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    kv_head = head // Q_PER_KV

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < HEAD_DIM
    row_mask = (m < q_len)[:, None] & d_mask[None, :]
    q_pos = context + m
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=row_mask)
    q = q.to(tl.float32)

    hi = tl.minimum(context + (tile + 1) * BLOCK_M, seq_len)  # past the tile's last query
    lo = 0
    if USE_WINDOW:  # before the first query's window
        lo = tl.maximum(context + tile * BLOCK_M - sliding_window + 1, 0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_table
    for tile_start in range(lo, hi, BLOCK_N):
        pos = tile_start + n
        valid = pos < hi
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, table, pos, valid, kv_head, d, d_mask,
            stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE,
        )  # fmt: skip
        scores = tile_scores(q, k, scale, softcap, USE_SOFTCAP, DOT_PRECISION)
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(scores, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = rows[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """query [T, Hq, D] of the flattened batch -> [T, Hq, D]; K/V already in the cache."""
    num_seqs = meta.seq_lens.shape[0]
    _, q_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    check_attention_inputs(query, k_cache, v_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
    d_pad = padded_dim(head_dim)
    if INTERPRETED:
        block_m, block_n, num_warps = 16, 16, 4
    else:  # sized from sm_90 builds (cuobjdump): no register spills in fp16/bf16/fp32 up to D = 256
        block_m, block_n = (64, 32) if d_pad <= 128 else (32, 16)
        num_warps = 4 if d_pad <= 64 else 8
    grid = (num_seqs, q_heads, triton.cdiv(meta.max_query_len, block_m))
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        softcap or 1.0,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        Q_PER_KV=q_heads // kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        DOT_PRECISION=dot_precision(query.dtype),
        num_warps=num_warps,
    )
    return out
