"""engine.model.cpu.huge_pages: tensors carved from huge-page-advised mappings."""

from __future__ import annotations

import gc
import itertools
import os
import re
from pathlib import Path

import pytest
import torch

from engine.model.cpu.huge_pages import HugePageArena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_tensors_are_zero_page_aligned_disjoint_and_outlive_the_arena():
    arena = HugePageArena(chunk_bytes=1 << 20)
    sizes = [
        (10, torch.float32),
        (1000, torch.bfloat16),
        (300_000, torch.float32),
        (5, torch.int64),
    ]
    tensors = [arena.empty(n, dtype) for n, dtype in sizes]
    for t, (n, dtype) in zip(tensors, sizes, strict=True):
        assert t.shape == (n,) and t.dtype == dtype and t.data_ptr() % 4096 == 0
        assert not t.any()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    # the 1.2 MB tensor did not fit the 1 MiB chunk's rest: it got a mapping of its own
    big = tensors[2]
    assert not 0 <= big.data_ptr() - tensors[0].data_ptr() < 1 << 20
    for value, t in enumerate(tensors, start=1):
        t.fill_(value)
    del arena
    gc.collect()
    assert all(bool((t == value).all()) for value, t in enumerate(tensors, start=1))
    assert big.sum().item() == 3 * big.numel()


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_a_large_tensor_lands_on_huge_pages():
    before = _anon_huge_kib()
    weights = HugePageArena().empty(64 << 18, torch.float32)  # 64 MiB
    weights.fill_(1.0)
    assert _anon_huge_kib() - before >= 32 << 10  # at least half of it, whatever the alignment


def _anon_huge_kib() -> int:
    text = Path(f"/proc/{os.getpid()}/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1))
