"""Torch paged attention against a naive per-sequence reference written independently here."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.model.attention import torch_reference
from engine.model.attention.backends import paged_attention
from engine.model.attention.metadata import AttentionMetadata

torch.set_num_threads(2)


@dataclass
class PagedBatch:
    """A random flattened batch: dense K/V per sequence, and the paged cache holding its context."""

    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D] new tokens
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], context already written
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]: context + new tokens
    dense_v: list[torch.Tensor]
    block_tables: list[list[int]]


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 5,
) -> PagedBatch:
    """Blocks are handed out in a random order so that every table is scattered in the pool."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n])
        used += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    # Garbage everywhere first: anything read outside a sequence's own slots shows up as an error.
    k_cache = rand(num_blocks, block_size, kv_heads, head_dim) * 100
    v_cache = rand(num_blocks, block_size, kv_heads, head_dim) * 100
    dense_k = [rand(s, kv_heads, head_dim) for s in seq_lens]
    dense_v = [rand(s, kv_heads, head_dim) for s in seq_lens]
    new_k, new_v = [], []
    for table, dk, dv, q_len, s_len in zip(
        tables, dense_k, dense_v, query_lens, seq_lens, strict=True
    ):
        for pos in range(s_len - q_len):  # cached context: written by earlier steps
            k_cache[table[pos // block_size], pos % block_size] = dk[pos]
            v_cache[table[pos // block_size], pos % block_size] = dv[pos]
        new_k.append(dk[s_len - q_len :])
        new_v.append(dv[s_len - q_len :])
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size)
    return PagedBatch(
        query=rand(sum(query_lens), q_heads, head_dim),
        key=torch.cat(new_k),
        value=torch.cat(new_v),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
        dense_k=dense_k,
        dense_v=dense_v,
        block_tables=tables,
    )


def reference_attention(
    batch: PagedBatch, scale: float, sliding_window: int | None, softcap: float | None
) -> torch.Tensor:
    """Per sequence, in float64: full scores against its dense K/V, explicit mask, softmax."""
    outs = []
    start = 0
    q_heads = batch.query.shape[1]
    for dk, dv, q_len in zip(batch.dense_k, batch.dense_v, batch.meta.query_lens_cpu, strict=True):
        s_len = dk.shape[0]
        q = batch.query[start : start + q_len].double().transpose(0, 1)  # [Hq, q, D]
        start += q_len
        group = q_heads // dk.shape[1]
        k = dk.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, s, D]
        v = dv.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(s_len - q_len, s_len)[:, None]
        k_pos = torch.arange(s_len)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
    return torch.cat(outs)


def check_cache_written(batch: PagedBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Every sequence's full K/V now sits in its slots."""
    block_size = k_cache.shape[1]
    for table, dk, dv in zip(batch.block_tables, batch.dense_k, batch.dense_v, strict=True):
        for pos in range(dk.shape[0]):
            slot = (table[pos // block_size], pos % block_size)
            assert torch.equal(k_cache[slot], dk[pos])
            assert torch.equal(v_cache[slot], dv[pos])


def assert_matches(out: torch.Tensor, expected: torch.Tensor, **tolerances: float) -> None:
    """Compare in the output's dtype, with that dtype's default tolerances unless given."""
    torch.testing.assert_close(out, expected.to(out.dtype), **tolerances)


def run_torch(batch: PagedBatch, **kwargs) -> torch.Tensor:
    return paged_attention(
        batch.query,
        batch.key,
        batch.value,
        batch.k_cache,
        batch.v_cache,
        batch.meta,
        backend="torch",
        **kwargs,
    )


SHAPES = {  # name: (query_lens, seq_lens)
    "decode": ([1, 1, 1, 1, 1], [1, 7, 16, 33, 5]),
    "prefill": ([9], [9]),
    "prefills_fresh_equal": ([7, 7, 7], [7, 7, 7]),
    "prefills_ragged": ([3, 17, 8, 1 + 1], [3, 17, 8, 2]),
    "chunked_prefill_cached": ([6, 11], [20, 11]),
    "mixed": ([1, 1, 1, 5, 13, 2], [9, 30, 1, 5, 40, 3]),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"), [(4, 2, 16), (6, 6, 24), (9, 3, 64), (8, 1, 24)]
)
def test_torch_path_matches_reference(shape: str, q_heads: int, kv_heads: int, head_dim: int):
    query_lens, seq_lens = SHAPES[shape]
    batch = make_batch(
        query_lens, seq_lens, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, seed=1
    )
    scale = head_dim**-0.5
    out = run_torch(batch, scale=scale)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert_matches(out, reference_attention(batch, scale, None, None))
    check_cache_written(batch, batch.k_cache, batch.v_cache)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("sliding_window", "softcap"), [(4, None), (None, 5.0), (7, 2.0)])
def test_sliding_window_and_softcap(shape: str, sliding_window: int | None, softcap: float | None):
    query_lens, seq_lens = SHAPES[shape]
    batch = make_batch(query_lens, seq_lens, q_heads=6, kv_heads=2, head_dim=24, seed=2)
    scale = 0.7  # large enough for scores to reach the soft cap
    out = run_torch(batch, scale=scale, sliding_window=sliding_window, softcap=softcap)
    expected = reference_attention(batch, scale, sliding_window, softcap)
    assert_matches(out, expected)


@pytest.mark.parametrize(
    ("shape", "causal"),
    [("prefill", True), ("prefills_fresh_equal", True), ("prefills_ragged", False),
     ("chunked_prefill_cached", False)],
)  # fmt: skip
def test_fresh_equal_prompts_take_sdpas_causal_path(monkeypatch, shape: str, causal: bool):
    """Prompts of one length computed from their first token skip the mask (SDPA is_causal with
    GQA); a window, a soft cap, a cached prefix or ragged lengths keep the masked path."""
    calls = []
    original = torch_reference._causal_attention
    monkeypatch.setattr(
        torch_reference, "_causal_attention", lambda *a: calls.append(1) or original(*a)
    )
    batch = make_batch(*SHAPES[shape], q_heads=9, kv_heads=3, head_dim=16, seed=4)
    assert_matches(run_torch(batch, scale=0.25), reference_attention(batch, 0.25, None, None))
    assert bool(calls) == causal
    calls.clear()
    run_torch(make_batch(*SHAPES[shape], q_heads=9, kv_heads=3, head_dim=16), scale=0.25,
              sliding_window=4)  # fmt: skip
    assert not calls


def test_every_layer_reuses_the_step_metadata():
    """Derived index/mask tensors are cached in the metadata; other layers/windows still agree."""
    batch = make_batch([1, 4, 7], [6, 4, 12], seed=3)
    for window in (None, 3, None, 5):
        cache_k, cache_v = batch.k_cache.clone(), batch.v_cache.clone()
        out = paged_attention(
            batch.query, batch.key, batch.value, cache_k, cache_v, batch.meta,
            scale=0.25, sliding_window=window, backend="torch",
        )  # fmt: skip
        assert_matches(out, reference_attention(batch, 0.25, window, None))


def test_prefills_of_very_different_lengths_are_split_into_groups():
    query_lens, seq_lens = [60, 2, 3, 50, 1, 1], [64, 2, 40, 50, 3, 70]
    batch = make_batch(query_lens, seq_lens, seed=4, block_size=8)
    out = run_torch(batch, scale=0.3)
    groups = batch.meta.derived["groups"]
    assert len(groups) >= 3  # decodes, long prefills, short prefills
    assert sorted(torch.cat([g.rows for g in groups]).tolist()) == list(range(sum(query_lens)))
    assert_matches(out, reference_attention(batch, 0.3, None, None))


def test_softcap_path_splits_large_score_matrices(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch_reference, "_MAX_SCORE_ELEMENTS", 64)
    batch = make_batch([12, 1], [20, 9], seed=5)
    out = run_torch(batch, scale=0.5, softcap=3.0, sliding_window=6)
    assert_matches(out, reference_attention(batch, 0.5, 6, 3.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_half_precision(dtype: torch.dtype, softcap: float | None):
    batch = make_batch([1, 1, 6, 9], [5, 19, 6, 14], q_heads=6, kv_heads=3, dtype=dtype, seed=6)
    out = run_torch(batch, scale=0.25, softcap=softcap)
    assert out.dtype == dtype
    expected = reference_attention(batch, 0.25, None, softcap)
    assert_matches(out, expected, atol=2e-2, rtol=2e-2)


def test_from_lists_slot_mapping():
    tables = [[7, 2], [0, 5, 3], [1]]
    meta = AttentionMetadata.from_lists([1, 6, 3], [6, 9, 3], tables, block_size=4)
    expected = [2 * 4 + 1]  # seq 0: position 5
    expected += [t * 4 + p % 4 for p, t in ((p, tables[1][p // 4]) for p in range(3, 9))]
    expected += [4, 5, 6]  # seq 2: positions 0..2 in block 1
    assert meta.slot_mapping.tolist() == expected
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 1, 7, 10]
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 2, 0], [0, 5, 3], [1, 0, 0]]
    assert (meta.max_query_len, meta.max_seq_len, meta.is_decode_only) == (6, 9, False)


def test_from_lists_rejects_a_table_too_short():
    with pytest.raises(ValueError, match="bad sequence layout"):
        AttentionMetadata.from_lists([1], [9], [[0, 1]], block_size=4)


def test_unknown_backend_is_rejected():
    batch = make_batch([1], [3])
    with pytest.raises(ValueError, match="unknown attention backend"):
        paged_attention(
            batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta,
            scale=1.0, backend="cuda-magic",
        )  # fmt: skip


def head_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, laid out as the runner passes them: a [T, H, D] view of a [H, T, D] tensor."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize("shape", ["decode", "mixed"])
def test_head_major_inputs_as_the_runner_passes_them(shape: str):
    batch = make_batch(*SHAPES[shape], q_heads=6, kv_heads=2, head_dim=24, seed=7)
    out = paged_attention(
        head_major(batch.query), head_major(batch.key), head_major(batch.value),
        batch.k_cache, batch.v_cache, batch.meta, scale=0.3, backend="torch",
    )  # fmt: skip
    assert out.is_contiguous()
    assert_matches(out, reference_attention(batch, 0.3, None, None))
    check_cache_written(batch, batch.k_cache, batch.v_cache)
