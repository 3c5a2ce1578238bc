"""Paged attention: write new K/V into the block pools, then attend over each sequence's blocks.

One function, `paged_attention`, serves every layer, through one of three backends
($MODELYARD_ATTENTION_BACKEND or the `backend` argument; auto when unset):
- "triton" (auto on CUDA): the Triton kernels of `engine.kernels`.
- "cpu" (auto on CPU when the C kernel builds): decode groups run the fused C kernel of
  `engine.cpu_kernels`, which reads K/V straight from the block pools (fp32 or bf16; other
  dtypes and prefill groups take the torch path).
- "torch" (the reference, and the fallback when no compiler is found): the vectorised torch path
  below. Sequences are never looped over in Python: each sequence's blocks are gathered with one
  indexing op, queries and keys are padded to [batch, max_len] and one masked
  `scaled_dot_product_attention` call (or a plain fp32 matmul/softmax when scores are soft-capped)
  covers the whole group; prompts of one length computed from their first token use SDPA's own
  causal mask instead.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.cpu_threads import all_threads, threads_by_work, threads_for

# "triton" | "cpu" | "torch" | unset (auto: triton on CUDA, cpu on CPU when its kernel builds)
BACKEND_ENV = "MODELYARD_ATTENTION_BACKEND"

# A prefill group's padded (query x key) area may exceed the sum of its sequences' real areas by
# this factor before the group is split; it bounds the work and memory wasted on padding.
_MAX_PADDING_RATIO = 2.0
# Score elements (fp32) the soft-capped matmul path materialises at once before it splits queries.
_MAX_SCORE_ELEMENTS = 1 << 25
# Inside cpu_threads.split_threads, attention runs multi-threaded from this many query x key
# multiply-adds (decode at batch 16, context 128 is faster on one thread, batch 64 on two).
_PARALLEL_MACS = 2e6
_PARALLEL_GATHER_ELEMENTS = 1e6
# The C decode kernel runs multi-threaded from this many visible-key x query-head x head-dim
# multiply-adds (per pass over K or V). Measured (passive wait policy, SmolLM2 shapes, context
# 144): batch 8 is even (153 us on one thread, 140 on two), batch 12 faster on two (262 vs 187).
# A lone sequence splits only by KV head (3 tasks for SmolLM2) and at context 2048 is still faster
# on one thread (289 vs 399 us): the thread wake-up is not amortised there.
_KERNEL_PARALLEL_MACS = 1e6


@dataclass
class AttentionMetadata:
    """Batch layout of one engine step, shared by every layer's attention call."""

    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token (flattened batch order)
    query_start_loc: torch.Tensor  # [B+1] int32 cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32 context length of each seq AFTER this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Index and mask tensors derived from the layout, built by the first layer and reused by the
    # others (keyed by what they depend on, e.g. the sliding window).
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata of a flattened batch from host lists.

        Sequence i contributes query_lens[i] new tokens at positions
        seq_lens[i] - query_lens[i] .. seq_lens[i] - 1; block_tables[i] must cover seq_lens[i].
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, seq_lens and block_tables must be non-empty, same length")
        # Host lists, then one tensor each: ~15 small torch ops here cost ~250 us per step
        # (batch 16), more than this Python walk over the new tokens.
        slots: list[int] = []
        starts = [0]
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 0 < q_len <= s_len or len(table) * block_size < s_len:
                raise ValueError(
                    f"bad sequence layout: q_len={q_len} seq_len={s_len} "
                    f"blocks={len(table)} block_size={block_size}"
                )
            for position in range(s_len - q_len, s_len):
                slots.append(table[position // block_size] * block_size + position % block_size)
            starts.append(starts[-1] + q_len)
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )


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
    backend: str | None = None,
) -> torch.Tensor:
    """Write key/value at meta.slot_mapping, then attend every sequence over its cached context.

    query [T, Hq, D]; key/value [T, Hkv, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D].
    Causal, GQA (Hq % Hkv == 0), sliding window (query i sees keys j with i - W < j <= i),
    soft-capped scores (softcap * tanh(s / softcap)) when given.
    Returns [T, Hq, D] in query's dtype.
    backend: "triton", "cpu" or "torch" forces a path (default: $MODELYARD_ATTENTION_BACKEND, else
    Triton on CUDA, the C decode kernel on CPU when it builds, torch otherwise).
    """
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} not a multiple of kv heads {key.shape[1]}")
    if sliding_window is not None and sliding_window <= 0:
        sliding_window = None
    choice = backend or os.environ.get(BACKEND_ENV) or _auto_backend(query)
    if choice == "triton":
        from engine import kernels  # deferred: importing Triton is slow and needs no GPU here

        kernels.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        attend = kernels.decode_attention if meta.is_decode_only else kernels.prefill_attention
        return attend(query, k_cache, v_cache, meta, scale, sliding_window, softcap)
    if choice not in ("cpu", "torch"):
        raise ValueError(
            f"unknown attention backend {choice!r}: expected 'triton', 'cpu' or 'torch'"
        )
    written = (
        choice == "cpu"
        and _slots_in_range(meta, k_cache)
        and cpu_kernels.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
    )
    if not written:
        write_kv_cache_torch(key, value, k_cache, v_cache, meta.slot_mapping)
    decode_kernel = (
        choice == "cpu" and cpu_kernels.supports(query, k_cache) and cpu_kernels.available()
    )
    return attend_torch(
        query, k_cache, v_cache, meta, scale, sliding_window, softcap, decode_kernel=decode_kernel
    )


def _slots_in_range(meta: AttentionMetadata, k_cache: torch.Tensor) -> bool:
    """Whether every slot of the step lies inside the pools (checked once per step)."""
    in_range = meta.derived.get("slots_in_range")
    if in_range is None:
        slots = meta.slot_mapping
        capacity = k_cache.shape[0] * k_cache.shape[1]
        in_range = meta.derived["slots_in_range"] = bool(
            slots.numel() and int(slots.min()) >= 0 and int(slots.max()) < capacity
        )
    return in_range


def _auto_backend(tensor: torch.Tensor) -> str:
    """The backend for tensors on ``tensor``'s device when none is asked for."""
    if tensor.is_cuda:
        return "triton"
    return "cpu" if tensor.device.type == "cpu" and cpu_kernels.available() else "torch"


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
    decode_kernel: bool = False,
) -> torch.Tensor:
    """Attention over the paged cache (which already holds this step's keys), torch ops only
    unless ``decode_kernel``: then the decode group runs the C kernel (the caller checked that it
    is available and supports these tensors)."""
    groups = meta.derived.get("groups")
    if groups is None:
        groups = meta.derived["groups"] = _plan_groups(meta)

    def attend(group: _Group) -> torch.Tensor:
        kernel = decode_kernel and max(group.query_lens) == 1
        attend_group = _attend_decode_kernel if kernel else _attend_group
        return attend_group(query, k_cache, v_cache, group, meta, scale, sliding_window, softcap)

    if len(groups) == 1 and groups[0].rows is None:
        return attend(groups[0])
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
    for group in groups:
        out.index_copy_(0, group.rows, attend(group))
    return out


def _attend_decode_kernel(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _Group,
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
    return cpu_kernels.paged_decode_attention(
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
) -> cpu_kernels.DecodeStep | None:
    """A decode-only step's per-layer rotary + cache write + attention as one C call each, when
    the "cpu" backend serves this step (fp32 or bf16 activations and CPU pools, every slot inside
    the pools); None: the caller rotates q/k and calls `paged_attention`.

    rotary: cos/sin [B, head_dim] of the step's tokens (rotate-half convention, as
    engine.cpu_kernels.fused_ops.FusedOps.rope takes them)."""
    choice = os.environ.get(BACKEND_ENV) or _auto_backend(k_cache)
    if (
        choice != "cpu"
        or not meta.is_decode_only
        or dtype not in (torch.float32, torch.bfloat16)
        or k_cache.device.type != "cpu"
        or k_cache.dtype not in (torch.float32, torch.bfloat16)
        or not cpu_kernels.available()
        or not _slots_in_range(meta, k_cache)
    ):
        return None
    _, block_size, kv_heads, head_dim = k_cache.shape
    visible = sum(meta.seq_lens_cpu)  # sizes the thread count; a sliding window only shrinks it
    return cpu_kernels.DecodeStep(
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
    )


@dataclass
class _Group:
    """Sequences attended together in one padded batch."""

    seq_ids: torch.Tensor | None  # indices into the batch, None = all sequences in order
    rows: torch.Tensor | None  # their token rows in the flattened batch, None = all rows
    query_lens: list[int]
    seq_lens: list[int]
    derived: dict = field(default_factory=dict)


def _plan_groups(meta: AttentionMetadata) -> list[_Group]:
    """Decodes form one group; prefills form groups whose padding stays bounded."""
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if meta.is_decode_only or len(q_lens) == 1:
        return [_Group(None, None, q_lens, s_lens)]
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
        _Group(
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
    group: _Group,
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


def _fresh_equal_prompts(group: _Group) -> bool:
    """Prompts of one length, all computed in this step from their first token (no cached prefix,
    no earlier chunk): plain causal attention with no mask to build."""
    length = group.query_lens[0]
    lens = zip(group.query_lens, group.seq_lens, strict=True)
    return length > 1 and all(q == length == s for q, s in lens)


def _causal_attention(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: _Group, scale: float
) -> torch.Tensor:
    """_attend_group for _fresh_equal_prompts: SDPA's own causal mask and GQA, which skip the
    masked half of the scores (1000-token SmolLM2 prompt: 9.1 instead of 13.3 ms a layer)."""
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
    k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group, meta: AttentionMetadata
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
    cost page faults on CPU, which measured up to ~3x slower at batch 64, context 1024."""
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
    group: _Group, meta: AttentionMetadata, span: int, sliding_window: int | None, q_per_kv: int
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
    group: _Group, mask: torch.Tensor, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """The mask as 0 / -inf scores: SDPA on CPU runs ~20% faster with it than with booleans."""
    key = ("bias", sliding_window, mask.shape, dtype)
    bias = group.derived.get(key)
    if bias is None:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        bias = group.derived[key] = bias.masked_fill_(~mask, float("-inf"))
    return bias


def _padded_rows(group: _Group, device: torch.device) -> torch.Tensor:
    """Flattened-batch row of every padded query slot [B*max_q] (padding repeats the last row)."""
    max_q = max(group.query_lens)
    q_lens = torch.tensor(group.query_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    offsets = torch.minimum(torch.arange(max_q)[None, :], (q_lens - 1)[:, None])
    rows = (starts[:, None] + offsets).reshape(-1)
    if group.rows is not None:  # the group's own rows index into the full batch
        rows = group.rows.cpu()[rows]
    return rows.to(device)


def _valid_rows(group: _Group, device: torch.device) -> torch.Tensor:
    """Positions of the real query rows within the padded [B*max_q] output, in batch order."""
    max_q = max(group.query_lens)
    q_lens = torch.tensor(group.query_lens)
    grid = torch.arange(max_q)[None, :] < q_lens[:, None]
    return torch.nonzero(grid.reshape(-1)).reshape(-1).to(device)
