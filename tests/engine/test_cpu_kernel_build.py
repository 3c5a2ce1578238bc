"""Building and loading the C kernels: one libgomp shared with torch, the torch path when no
compiler works, and old builds removed."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from engine.model import cache_dir
from engine.model.attention.backends import BACKEND_ENV, paged_attention, select_backend
from engine.model.cpu.kernels import build
from tests.engine.test_attention import make_batch, reference_attention
from tests.engine.test_cpu_decode_kernel import ATOL

pytestmark = pytest.mark.skipif(
    not build.available(), reason="no C compiler: the kernel cannot be built here"
)


def test_single_libgomp_shared_with_torch():
    """The kernel links libgomp.so.1 by soname: torch's copy, already mapped, is reused."""
    build.load()
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


def test_no_compiler_falls_back_to_torch(monkeypatch, tmp_path: Path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MODELYARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    build.reset()
    try:
        batch = make_batch([1, 4, 1], [9, 4, 20], q_heads=4, kv_heads=2, head_dim=16)
        with caplog.at_level(logging.WARNING, logger="engine.model.cpu.kernels.build"):
            for backend in (select_backend(batch.query.device), "cpu"):
                out = paged_attention(
                    batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                    batch.meta, scale=0.25, backend=backend,
                )  # fmt: skip
                torch.testing.assert_close(
                    out.double(), reference_attention(batch, 0.25, None, None), atol=ATOL,
                    rtol=1e-5,
                )  # fmt: skip
        warnings = [r for r in caplog.records if r.name == "engine.model.cpu.kernels.build"]
        assert len(warnings) == 1 and "no-such-cc" in warnings[0].getMessage()
        assert build.load() is None
    finally:
        build.reset()


def test_builds_unused_for_weeks_are_removed(monkeypatch, tmp_path: Path):
    """A new build removes builds that no process loaded for STALE_AFTER_S (two weeks); loading a
    build marks it used."""
    monkeypatch.setenv("MODELYARD_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "cpu_kernels"
    folder.mkdir()
    stale, recent = folder / "cpu_kernels-stale.so", folder / "cpu_kernels-recent.so"
    stale.write_bytes(b"")
    recent.write_bytes(b"")
    weeks_ago = time.time() - cache_dir.STALE_AFTER_S - 3600
    os.utime(stale, (weeks_ago, weeks_ago))
    built = build._build(["cc"])
    assert built.exists() and recent.exists() and not stale.exists()
    os.utime(built, (weeks_ago, weeks_ago))
    assert build._build(["cc"]) == built  # found, not rebuilt: marked used
    assert built.stat().st_mtime > time.time() - 60
