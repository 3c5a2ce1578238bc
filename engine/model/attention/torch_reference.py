"""The reference attention over the paged cache, torch ops only (the "torch" backend, and what
the "cpu" backend runs for prefill groups).

Sequences are never looped over in Python: each sequence's blocks are gathered with one indexing
op, queries and keys are padded to [batch, max_len] and one masked `scaled_dot_product_attention`
call (or a plain fp32 matmul/softmax when scores are soft-capped) covers the whole group; prompts
of one length computed from their first token use SDPA's own causal mask instead. A step's
sequences form groups (`_plan_groups`): the decodes, then prefills whose padding stays bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.attention.metadata import AttentionMetadata
from engine.model.cpu.threads import threads_by_work

# A prefill group's padded (query x key) area may exceed the sum of its sequences' real areas by
# this factor before the group is split; it bounds the work and memory wasted on padding.
_MAX_PADDING_RATIO = 2.0
# Score elements (fp32) the soft-capped matmul path materialises at once before it splits queries.
_MAX_SCORE_ELEMENTS = 1 << 25
# Inside engine.model.cpu.threads.split_threads, attention runs multi-threaded from this many
# query x key multiply-adds: smaller calls are faster on one thread than they gain from waking the
# others (where it crossed over: docs/PERFORMANCE.md#thread-wake-ups).
_PARALLEL_MACS = 2e6
_PARALLEL_GATHER_ELEMENTS = 1e6


@dataclass
class AttentionGroup:
    """Sequences attended together in one padded batch."""

    seq_ids: torch.Tensor | None  # indices into the batch, None = all sequences in order
    rows: torch.Tensor | None  # their token rows in the flattened batch, None = all rows
    query_lens: list[int]
    seq_lens: list[int]
    derived: dict = field(default_factory=dict)


# One group's attention: (query, k_cache, v_cache, group, meta, scale, sliding_window, softcap)
# -> its rows [sum(query_lens), Hq, D] in batch order.
GroupAttention = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttentionGroup,
        AttentionMetadata,
        float,
        int | None,
        float | None,
    ],
    torch.Tensor,
]


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    flat = (num_blocks * block_size, kv_heads, head_dim)
    k_cache.view(flat).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(flat).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def attend_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    *,
    decode_groups: GroupAttention | None = None,
) -> torch.Tensor:
    """Attention over the paged cache (which already holds this step's keys), torch ops only
    unless ``decode_groups`` is given: it then attends the decode group (one query token per
    sequence) instead (the "cpu" backend's C kernel)."""
    groups = meta.derived.get("groups")
    if groups is None:
        groups = meta.derived["groups"] = _plan_groups(meta)

    def attend(group: AttentionGroup) -> torch.Tensor:
        is_decode = decode_groups is not None and max(group.query_lens) == 1
        attend_group = decode_groups if is_decode else _attend_group
        return attend_group(query, k_cache, v_cache, group, meta, scale, sliding_window, softcap)

    if len(groups) == 1 and groups[0].rows is None:
        return attend(groups[0])
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
    for group in groups:
        out.index_copy_(0, group.rows, attend(group))
    return out


def _plan_groups(meta: AttentionMetadata) -> list[AttentionGroup]:
    """Decodes form one group; prefills form groups whose padding stays bounded."""
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if meta.is_decode_only or len(q_lens) == 1:
        return [AttentionGroup(None, None, q_lens, s_lens)]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    decodes = [i for i, q in enumerate(q_lens) if q == 1]
    prefills = sorted((i for i, q in enumerate(q_lens) if q > 1), key=lambda i: -s_lens[i])
    batches: list[list[int]] = [decodes] if decodes else []
    current: list[int] = []
    real_area = 0
    for i in prefills:
        area = q_lens[i] * s_lens[i]
        members = [*current, i]
        padded = len(members) * max(q_lens[j] for j in members) * s_lens[members[0]]
        if current and padded > _MAX_PADDING_RATIO * (real_area + area):
            batches.append(current)
            members, real_area = [i], 0
        current, real_area = members, real_area + area
    batches.append(current)
    device = meta.slot_mapping.device
    return [
        AttentionGroup(
            seq_ids=torch.tensor(ids, device=device),
            rows=torch.cat([torch.arange(starts[i], starts[i + 1]) for i in ids]).to(device),
            query_lens=[q_lens[i] for i in ids],
            seq_lens=[s_lens[i] for i in ids],
        )
        for ids in batches
    ]


def _attend_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Padded attention of one group; returns its rows [sum(query_lens), Hq, D] in batch order."""
    num_seqs, max_q = len(group.seq_lens), max(group.query_lens)
    q_heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[2]
    q_per_kv = q_heads // kv_heads
    k, v = _gather_context(k_cache, v_cache, group, meta)  # [B, S, Hkv, D]
    if k.dtype != query.dtype:  # a KV cache stored narrower than the model computes
        k, v = k.to(query.dtype), v.to(query.dtype)
    if softcap is None and sliding_window is None and _fresh_equal_prompts(group):
        return _causal_attention(query, k, v, group, scale)
    mask = _mask(group, meta, k.shape[1], sliding_window, q_per_kv)  # [B, 1, G*max_q or 1, S]

    if max_q == 1:
        q = query if group.rows is None else query.index_select(0, group.rows)
        q = q.reshape(num_seqs, kv_heads, q_per_kv, head_dim)  # a view when contiguous
    else:
        rows = group.derived.get("padded_rows")
        if rows is None:
            rows = group.derived["padded_rows"] = _padded_rows(group, query.device)
        # [B*max_q, Hq, D] -> [B, Hkv, G*max_q, D]: the G query heads of a KV head side by side,
        # so K/V are shared through the batch dim instead of being repeated per query head.
        q = query.index_select(0, rows).view(num_seqs, max_q, kv_heads, q_per_kv, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, q_per_kv * max_q, head_dim)

    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D] strided views, no copy
    with threads_by_work(q.numel() * k.shape[2], _PARALLEL_MACS):
        if softcap is None:
            bias = _additive_mask(group, mask, sliding_window, q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        else:
            out = _softcapped_attention(q, k, v, mask, scale, softcap)

    if max_q == 1:
        return out.reshape(num_seqs, q_heads, head_dim).contiguous()
    out = out.view(num_seqs, kv_heads, q_per_kv, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_q, q_heads, head_dim)
    valid = group.derived.get("valid_rows")
    if valid is None:
        valid = group.derived["valid_rows"] = _valid_rows(group, query.device)
    return out.index_select(0, valid)


def _fresh_equal_prompts(group: AttentionGroup) -> bool:
    """Prompts of one length, all computed in this step from their first token (no cached prefix,
    no earlier chunk): plain causal attention with no mask to build."""
    length = group.query_lens[0]
    lens = zip(group.query_lens, group.seq_lens, strict=True)
    return length > 1 and all(q == length == s for q, s in lens)


def _causal_attention(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup, scale: float
) -> torch.Tensor:
    """_attend_group for _fresh_equal_prompts: SDPA's own causal mask and GQA, which skip the
    masked half of the scores (figures: docs/PERFORMANCE.md#torch-attention)."""
    num_seqs, length = len(group.seq_lens), group.query_lens[0]
    q = query if group.rows is None else query.index_select(0, group.rows)
    q = q.view(num_seqs, length, *query.shape[1:]).transpose(1, 2)  # [B, Hq, L, D]
    k, v = k[:, :length].transpose(1, 2), v[:, :length].transpose(1, 2)  # [B, Hkv, L, D]
    with threads_by_work(q.numel() * length // 2, _PARALLEL_MACS):
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    return out.transpose(1, 2).reshape(num_seqs * length, *query.shape[1:])


def _softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Plain fp32 attention with tanh soft-capping (SDPA cannot cap), chunked over query rows."""
    batch, kv_heads, rows, _ = q.shape
    chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, batch * kv_heads * k.shape[2]))
    k_t, v32 = k.float().transpose(-1, -2), v.float()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for start in range(0, rows, chunk):
        part = slice(start, start + chunk)
        scores = torch.matmul(q[:, :, part].float(), k_t) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(~(mask if mask.shape[2] == 1 else mask[:, :, part]), float("-inf"))
        out[:, :, part] = torch.matmul(torch.softmax(scores, dim=-1), v32).to(q.dtype)
    return out


def _gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's blocks, in order, as [B, S, Hkv, D] (S = its padded block span)."""
    block_size = k_cache.shape[1]
    block_ids = group.derived.get("block_ids")
    if block_ids is None:
        num_blocks = -(-max(group.seq_lens) // block_size)
        tables = meta.block_tables if group.seq_ids is None else meta.block_tables[group.seq_ids]
        block_ids = group.derived["block_ids"] = tables[:, :num_blocks].reshape(-1).long()
    num_seqs = len(group.seq_lens)
    shape = (num_seqs, block_ids.numel() // num_seqs * block_size, *k_cache.shape[2:])
    k_buf, v_buf = _workspace(k_cache, block_ids.numel())
    with threads_by_work(k_buf.numel(), _PARALLEL_GATHER_ELEMENTS):
        torch.index_select(k_cache, 0, block_ids, out=k_buf)
        torch.index_select(v_cache, 0, block_ids, out=v_buf)
    return k_buf.view(shape), v_buf.view(shape)


_workspaces = threading.local()


def _workspace(cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reused gather buffers (kept at the largest size seen): fresh multi-MB tensors in every layer
    cost page faults on CPU (figures: docs/PERFORMANCE.md#torch-attention)."""
    store = _workspaces.__dict__.setdefault("buffers", {})
    key = (cache.device, cache.dtype, tuple(cache.shape[1:]))
    buffers = store.get(key)
    if buffers is None or buffers[0].shape[0] < num_blocks:
        capacity = max(num_blocks, 2 * buffers[0].shape[0] if buffers is not None else 0)
        shape = (capacity, *cache.shape[1:])
        buffers = store[key] = (
            torch.empty(shape, dtype=cache.dtype, device=cache.device),
            torch.empty(shape, dtype=cache.dtype, device=cache.device),
        )
    return buffers[0][:num_blocks], buffers[1][:num_blocks]


def _mask(
    group: AttentionGroup,
    meta: AttentionMetadata,
    span: int,
    sliding_window: int | None,
    q_per_kv: int,
) -> torch.Tensor:
    """Boolean [B, 1, G*max_q, S] mask ([B, 1, 1, S] for decodes): causal, within the sequence,
    within the sliding window."""
    key = ("mask", sliding_window, q_per_kv)
    mask = group.derived.get(key)
    if mask is not None:
        return mask
    device = meta.slot_mapping.device
    q_lens = torch.tensor(group.query_lens, device=device)
    s_lens = torch.tensor(group.seq_lens, device=device)
    max_q = max(group.query_lens)
    # Padded query rows repeat the sequence's last position so that no row is fully masked.
    offsets = torch.minimum(torch.arange(max_q, device=device)[None, :], (q_lens - 1)[:, None])
    positions = (s_lens - q_lens)[:, None] + offsets  # [B, max_q]
    keys = torch.arange(span, device=device)[None, None, :]
    mask = keys <= positions[:, :, None]  # causal; also keeps keys inside the sequence
    if sliding_window is not None:
        mask &= keys > positions[:, :, None] - sliding_window
    if max_q == 1:  # decode: one mask row per sequence, broadcast over its query heads
        mask = mask[:, None]
    else:
        mask = mask[:, None, None].expand(-1, 1, q_per_kv, -1, -1)
        mask = mask.reshape(len(group.seq_lens), 1, q_per_kv * max_q, span)
    group.derived[key] = mask
    return mask


def _additive_mask(
    group: AttentionGroup, mask: torch.Tensor, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """The mask as 0 / -inf scores: SDPA on CPU runs faster with it than with booleans (figures:
    docs/PERFORMANCE.md#torch-attention)."""
    key = ("bias", sliding_window, mask.shape, dtype)
    bias = group.derived.get(key)
    if bias is None:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        bias = group.derived[key] = bias.masked_fill_(~mask, float("-inf"))
    return bias


def _padded_rows(group: AttentionGroup, device: torch.device) -> torch.Tensor:
    """Flattened-batch row of every padded query slot [B*max_q] (padding repeats the last row)."""
    max_q = max(group.query_lens)
    q_lens = torch.tensor(group.query_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    offsets = torch.minimum(torch.arange(max_q)[None, :], (q_lens - 1)[:, None])
    rows = (starts[:, None] + offsets).reshape(-1)
    if group.rows is not None:  # the group's own rows index into the full batch
        rows = group.rows.cpu()[rows]
    return rows.to(device)


def _valid_rows(group: AttentionGroup, device: torch.device) -> torch.Tensor:
    """Positions of the real query rows within the padded [B*max_q] output, in batch order."""
    max_q = max(group.query_lens)
    q_lens = torch.tensor(group.query_lens)
    grid = torch.arange(max_q)[None, :] < q_lens[:, None]
    return torch.nonzero(grid.reshape(-1)).reshape(-1).to(device)
