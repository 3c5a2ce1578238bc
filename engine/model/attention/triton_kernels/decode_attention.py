"""Triton kernel: decode attention (one query token per sequence) over paged K/V.

One program per (sequence, KV head, split): its G = Hq / Hkv query heads form the rows of one
tile, so each K/V tile is loaded once for the whole GQA group. The context is walked in
BLOCK_N-token tiles whose slots are looked up through the block table; softmax is computed online in
fp32. When the batch alone cannot fill the GPU (few sequences, long contexts), the context is split
across several programs whose partial results a second kernel merges (split-K, "flash decoding").
"""

from __future__ import annotations

import functools
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
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    scale,
    softcap,
    sliding_window,
    num_splits,
    split_size,
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
    G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < HEAD_DIM
    q_rows = (g < Q_PER_KV)[:, None] & d_mask[None, :]
    heads = kv_head * Q_PER_KV + g
    q_off = seq * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_rows, other=0.0).to(tl.float32)

    start = 0
    if USE_WINDOW:  # the query sits at seq_len - 1 and sees keys j > seq_len - 1 - W
        start = tl.maximum(seq_len - sliding_window, 0)
    end = seq_len
    if SPLIT:  # this program's share of the context (possibly empty)
        start = tl.maximum(start, split * split_size)
        end = tl.minimum(end, (split + 1) * split_size)

    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_table
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + n
        valid = pos < end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, table, pos, valid, kv_head, d, d_mask,
            stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE,
        )  # fmt: skip
        scores = tile_scores(q, k, scale, softcap, USE_SOFTCAP, DOT_PRECISION)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(scores, v, m_i, l_i, acc, DOT_PRECISION)

    if SPLIT:  # unnormalised partials, [B, Hq, splits] (+ [D]); the merge kernel finishes them
        part = (seq * tl.num_programs(1) * Q_PER_KV + heads) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=g < Q_PER_KV)
        tl.store(part_sum_ptr + part, l_i, mask=g < Q_PER_KV)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=q_rows)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_off = seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_rows)


@triton.jit
def _merge_splits_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One program per (sequence, query head): rescale each split to the common max and sum."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + s
    part_max = tl.load(part_max_ptr + part, mask=s_mask, other=-1.0e30)
    part_sum = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    acc_mask = s_mask[:, None] & (d < HEAD_DIM)[None, :]
    part_acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=acc_mask, other=0.0
    )
    weight = tl.exp2(part_max - tl.max(part_max, axis=0))  # empty splits: sum and acc are 0
    total = tl.sum(part_sum * weight, axis=0)
    out = tl.sum(part_acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    o_off = seq * stride_ot + head * stride_oh + d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


_MAX_SPLITS = 64


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Splits for ~2 programs per SM, each over >= 256 keys; 1 when the batch fills the GPU."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    wanted = triton.cdiv(2 * sms, num_programs)
    return max(1, min(wanted, triton.cdiv(max_seq_len, 256), _MAX_SPLITS))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """query [B, Hq, D] (one token per sequence) -> [B, Hq, D]; K/V already in the cache.

    num_splits: context partitions per (sequence, KV head); None picks from the GPU's size.
    """
    num_seqs, q_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    check_attention_inputs(query, k_cache, v_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
    q_per_kv = q_heads // kv_heads
    d_pad = padded_dim(head_dim)
    # Sized from sm_90 builds (cuobjdump): <= ~130 registers per thread, no spills, up to D = 256.
    block_n = 32 if d_pad <= 64 and not INTERPRETED else 16
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * kv_heads, meta.max_seq_len, query.device)
    split_size = triton.cdiv(triton.cdiv(meta.max_seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(meta.max_seq_len, split_size)  # none left empty for every sequence
    if num_splits > 1:
        part_max = torch.empty(num_seqs, q_heads, num_splits, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(num_seqs, q_heads, num_splits, head_dim, device=query.device)
    else:
        part_max = part_sum = part_acc = out  # unused
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.seq_lens,
        part_max,
        part_sum,
        part_acc,
        scale,
        softcap or 1.0,
        sliding_window or 0,
        num_splits,
        split_size,
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
        Q_PER_KV=q_per_kv,
        G_PAD=padded_dim(q_per_kv),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        DOT_PRECISION=dot_precision(query.dtype),
        SPLIT=num_splits > 1,
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, q_heads)](
            part_max,
            part_sum,
            part_acc,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out
