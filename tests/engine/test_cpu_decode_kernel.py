"""The fused C decode kernel against the torch path and a naive per-sequence reference, and the
paged K/V read the benchmark's attention floor uses. The fused decode step (rotary, cache writes,
the qkv projection): test_cpu_decode_step.py; building the kernels: test_cpu_kernel_build.py."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import torch_reference
from engine.model.attention.backends import BACKEND_ENV, paged_attention, select_backend
from engine.model.attention.torch_reference import write_kv_cache_torch
from engine.model.cpu.kernels import build, paged_decode
from tests.engine.test_attention import PagedBatch, make_batch, reference_attention

torch.set_num_threads(2)

pytestmark = pytest.mark.skipif(
    not build.available(), reason="no C compiler: the kernel cannot be built here"
)

RAGGED = [1, 15, 16, 17, 130, 600]  # 600: three of the kernel's 256-key chunks
ATOL = 1e-5


def naive_decode(
    batch: PagedBatch, scale: float, window: int | None, softcap: float | None
) -> torch.Tensor:
    """One query per sequence; its visible keys looked up one by one through its block table,
    then per query head a max-subtracted softmax, in float64."""
    q_heads = batch.query.shape[1]
    block_size, kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    for b, table in enumerate(batch.block_tables):
        seq_len = batch.meta.seq_lens_cpu[b]
        visible = [j for j in range(seq_len) if not window or j > seq_len - 1 - window]
        slots = [(table[j // block_size], j % block_size) for j in visible]
        keys = torch.stack([batch.k_cache[blk, off] for blk, off in slots]).double()
        values = torch.stack([batch.v_cache[blk, off] for blk, off in slots]).double()
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            scores = (keys[:, kv] @ batch.query[b, h].double()) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.exp(scores - scores.max())
            out[b, h] = (weights / weights.sum()) @ values[:, kv]
    return out


def decode_batch(
    q_heads: int, kv_heads: int, head_dim: int, seed: int = 0, block_size: int = 16
) -> PagedBatch:
    """Ragged decode batch with shuffled block tables; the current token's K/V already written."""
    batch = make_batch(
        [1] * len(RAGGED), RAGGED, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, seed=seed,
    )  # fmt: skip
    write_kv_cache_torch(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping
    )
    return batch


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (20, None), (300, None), (None, 5.0), (8, 2.0)]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_references(q_heads, kv_heads, head_dim, window, softcap, threads):
    batch = decode_batch(q_heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = paged_decode.paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens,
        scale, window, softcap, threads,
    )  # fmt: skip
    torch_out = torch_reference.attend_torch(
        batch.query, batch.k_cache, batch.v_cache, batch.meta, scale, window, softcap
    )
    torch.testing.assert_close(out, torch_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out.double(), reference_attention(batch, scale, window, softcap),
                               atol=ATOL, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(out.double(), naive_decode(batch, scale, window, softcap),
                               atol=ATOL, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("block_size", [8, 24, 32])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("window", [None, 300])
def test_kernel_with_other_block_sizes(block_size, head_dim, window):
    """Tiles stop at block ends and at the kernel's 16-aligned chunk ends, whatever the block."""
    batch = decode_batch(9, 3, head_dim, seed=block_size, block_size=block_size)
    out = paged_decode.paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens,
        0.125, window, None, 2,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), naive_decode(batch, 0.125, window, None),
                               atol=ATOL, rtol=1e-5)  # fmt: skip


def test_kernel_reads_a_strided_table_and_a_non_contiguous_query():
    """Table rows with padding beyond max_blocks (a column slice) and a head-major query view."""
    batch = decode_batch(9, 3, 64, seed=3)
    max_blocks = batch.meta.block_tables.shape[1]
    wide = torch.full((len(RAGGED), max_blocks + 7), 10**6, dtype=torch.int32)
    wide[:, :max_blocks] = batch.meta.block_tables
    table_view = wide[:, :max_blocks]
    query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    out = paged_decode.paged_decode_attention(
        query, batch.k_cache, batch.v_cache, table_view, batch.meta.seq_lens, 0.125, None, None, 2
    )
    torch.testing.assert_close(out.double(), reference_attention(batch, 0.125, None, None),
                               atol=ATOL, rtol=1e-5)  # fmt: skip


def test_kernel_rejects_what_it_does_not_support():
    batch = decode_batch(4, 2, 24)
    args = (batch.meta.block_tables, batch.meta.seq_lens, 0.2, None, None, 1)
    assert not paged_decode.supports(batch.query.half(), batch.k_cache)
    with pytest.raises(TypeError):
        paged_decode.paged_decode_attention(
            batch.query.double(), batch.k_cache, batch.v_cache, *args
        )
    with pytest.raises(ValueError):
        paged_decode.paged_decode_attention(
            batch.query, batch.k_cache.transpose(1, 2), batch.v_cache, *args
        )
    with pytest.raises(TypeError):
        paged_decode.paged_decode_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables.long(),
            *args[1:],
        )  # fmt: skip


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (6, None), (None, 4.0)])
def test_mixed_batch_through_paged_attention(window, softcap, monkeypatch):
    """Decode rows interleaved with prefills: the decode group runs the kernel, prefills torch."""
    query_lens, seq_lens = [1, 1, 7, 1, 13, 2, 1], [9, 30, 7, 1, 40, 3, 130]
    calls = []
    real = paged_decode.paged_decode_attention
    monkeypatch.setattr(
        paged_decode, "paged_decode_attention", lambda *a: calls.append(a[0].shape) or real(*a)
    )
    outs = {}
    for backend in ("cpu", "torch"):
        batch = make_batch(query_lens, seq_lens, q_heads=9, kv_heads=3, head_dim=64, seed=5)
        outs[backend] = paged_attention(
            batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta,
            scale=0.125, sliding_window=window, softcap=softcap, backend=backend,
        )  # fmt: skip
    assert calls == [torch.Size([4, 9, 64])]  # only the four decode rows, only with "cpu"
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=ATOL, rtol=1e-5)
    expected = reference_attention(batch, 0.125, window, softcap)
    torch.testing.assert_close(outs["cpu"].double(), expected, atol=ATOL, rtol=1e-5)


def test_auto_backend_on_cpu_uses_the_kernel(monkeypatch):
    """The backend chosen for a CPU model (select_backend, as the runner calls it at load) runs
    the kernel; $MODELYARD_ATTENTION_BACKEND=torch chooses the reference path instead."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    calls = []
    real = paged_decode.paged_decode_attention
    monkeypatch.setattr(
        paged_decode, "paged_decode_attention", lambda *a: calls.append(1) or real(*a)
    )
    batch = make_batch([1, 1], [5, 17], q_heads=4, kv_heads=2, head_dim=16)
    out = paged_attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                          batch.meta, scale=0.25,
                          backend=select_backend(batch.query.device))  # fmt: skip
    assert calls == [1]
    torch.testing.assert_close(out.double(), reference_attention(batch, 0.25, None, None),
                               atol=ATOL, rtol=1e-5)  # fmt: skip
    monkeypatch.setenv(BACKEND_ENV, "torch")  # the reference path, kernel untouched
    paged_attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                    batch.meta, scale=0.25,
                    backend=select_backend(batch.query.device))  # fmt: skip
    assert calls == [1]


def test_peaked_scores_and_nan_rows():
    """Scores hundreds apart (exp underflows to 0) still match; a NaN query head gives NaN in that
    head only, as the torch path does."""
    batch = decode_batch(9, 3, 64, seed=11)
    args = (batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens)
    out = paged_decode.paged_decode_attention(batch.query, *args, 4.0, None, None, 1)
    torch.testing.assert_close(out.double(), naive_decode(batch, 4.0, None, None), atol=ATOL,
                               rtol=1e-5)  # fmt: skip
    batch.query[2, 4, 7] = float("nan")
    out = paged_decode.paged_decode_attention(batch.query, *args, 0.125, None, None, 1)
    nan = torch.zeros(out.shape, dtype=torch.bool)
    nan[2, 4] = True
    assert torch.equal(out.isnan(), nan)
    torch_out = torch_reference.attend_torch(batch.query, *args[:2], batch.meta, 0.125, None, None)
    assert torch.equal(torch_out.isnan(), nan)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, 5.0)])
@pytest.mark.parametrize("head_dim", [64, 128, 24])  # 24: widened for the portable tiles
def test_bf16_pools(window, softcap, head_dim):
    """bf16 K/V are widened exactly: an fp32 query matches the float64 reference of the same bf16
    values tightly; a bf16 query returns bf16 within bf16 rounding."""
    batch = make_batch([1] * len(RAGGED), RAGGED, q_heads=9, kv_heads=3, head_dim=head_dim,
                       block_size=16, dtype=torch.bfloat16, seed=2)  # fmt: skip
    write_kv_cache_torch(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping
    )
    args = (batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens, 0.125)
    expected = reference_attention(batch, 0.125, window, softcap)  # float64 of the bf16 values
    out = paged_decode.paged_decode_attention(batch.query.float(), *args, window, softcap, 2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=1e-5)
    out = paged_decode.paged_decode_attention(batch.query, *args, window, softcap, 1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16))


def test_bf16_mixed_batch_through_paged_attention():
    query_lens, seq_lens = [1, 9, 1, 1], [40, 9, 1, 17]
    outs = {}
    for backend in ("cpu", "torch"):
        batch = make_batch(query_lens, seq_lens, q_heads=9, kv_heads=3, head_dim=64,
                           dtype=torch.bfloat16, seed=4)  # fmt: skip
        outs[backend] = paged_attention(
            batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta,
            scale=0.125, backend=backend,
        )  # fmt: skip
    expected = reference_attention(batch, 0.125, None, None).to(torch.bfloat16)
    for out in outs.values():  # prefill rows are computed in bf16 by torch: looser atol
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_sequences_split_by_kv_head(q_heads, kv_heads, dtype):
    """Fewer sequences than twice the threads: the kernel splits each by KV head."""
    batch = make_batch([1, 1], [130, 17], q_heads=q_heads, kv_heads=kv_heads, head_dim=24,
                       block_size=16, dtype=dtype, seed=9)  # fmt: skip
    write_kv_cache_torch(
        batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping
    )
    expected = reference_attention(batch, 0.2, 50, None)
    for threads in (1, 2, 3):
        out = paged_decode.paged_decode_attention(
            batch.query.float(), batch.k_cache, batch.v_cache, batch.meta.block_tables,
            batch.meta.seq_lens, 0.2, 50, None, threads,
        )  # fmt: skip
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=1e-5)


def _xor_words(rows: torch.Tensor) -> int:
    """XOR of a tensor's bytes taken as little-endian 64-bit words."""
    words = rows.contiguous().view(torch.uint8).view(-1, 8).to(torch.int64)
    word = (words << (8 * torch.arange(8))).sum(dim=1)  # wraps like uint64 in two's complement
    mix = 0
    for value in word.tolist():
        mix ^= value & (2**64 - 1)
    return mix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_read_paged_kv_reads_exactly_the_visible_rows(dtype, threads):
    """The benchmark's attention floor reads each sequence's rows [0, seq_len) of every layer's
    pools through its table, no more (rows past seq_len hold data that would change the XOR)."""
    generator = torch.Generator().manual_seed(0)
    layers, blocks, block_size, kv_heads, head_dim = 3, 24, 4, 2, 8
    caches = [
        tuple(
            torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
            for _ in range(2)
        )
        for _ in range(layers)
    ]
    seq_lens = torch.tensor([1, 4, 5, 11, 0], dtype=torch.int32)
    order = torch.randperm(blocks, generator=generator).to(torch.int32)
    tables = torch.stack([order[i * 4 : i * 4 + 4] for i in range(len(seq_lens))])
    expected = 0
    for k_cache, v_cache in caches:
        for table, seq_len in zip(tables.tolist(), seq_lens.tolist(), strict=True):
            for pool in (k_cache, v_cache):
                rows = pool[table].flatten(0, 1)[:seq_len]  # [seq_len, Hkv, D]
                expected ^= _xor_words(rows)
    assert paged_decode.read_paged_kv(caches, tables, seq_lens, threads) == expected
    with pytest.raises(ValueError, match="outside the pools"):
        paged_decode.read_paged_kv(caches, tables + blocks, seq_lens, threads)
