"""What a real Q4_K_M GGUF costs an engine once loaded, from its own ``GET /status`` (and
/proc): Gemma 3 270M's weights held in the file's blocks (no fp32 copy of a quantised tensor, the
tied embedding read from the lm_head's packed rows), one tokenizer and no structured-outputs
vocabulary before a constraint asks for it.

Bounds, from the measurements (docs/PERFORMANCE.md#model-loading: 253 MB file, 256 MiB KV, RSS
1,273 MiB, weights 0.30 GB; the tree before them: RSS 2,356 MiB, weights 0.52 GB): the weights
within 1.4x the file (the int8 and int8k records widen Q5_0 and Q6_K blocks), the whole process
within the file + the KV budget + 1 GiB for the interpreter, torch, transformers, the tokenizer,
activations and allocator slack. An fp32 copy of the embedding alone (671 MB) or the tokenizer's
former copies (~400 MB each) break them.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from common.processes import pss_bytes, rss_bytes
from engine.model.cpu import narrow_cache, packed_cache
from engine.model.cpu.kernels import quant_gemm
from engine.model.cpu.packed_cache import MappedFile, open_mapped
from engine.model.loader import known_gguf_dir
from tests.conftest import GEMMA_GGUF
from tests.server_utils import EngineProcess

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not GEMMA_GGUF.exists(), reason="Gemma 3 GGUF not fetched"),
]

KV_BYTES = 64 * 2**20


def test_a_q4_k_m_file_loads_at_about_its_size() -> None:
    flags = ("--kv-cache-memory", "64MiB", "--num-threads", "2", "--max-model-len", "1024")
    engine = EngineProcess(GEMMA_GGUF, *flags).wait_ready()
    try:
        status = _status(engine)
        memory = status["memory"]
        file_bytes = GEMMA_GGUF.stat().st_size
        assert memory["kv_cache_bytes"] <= KV_BYTES
        assert 0.5 * file_bytes < memory["weights_bytes"] <= 1.4 * file_bytes
        assert memory["rss_bytes"] <= file_bytes + KV_BYTES + 2**30
        assert 0 < memory["pss_bytes"] <= memory["rss_bytes"]
        # the engine's own figures are its process's, as /proc shows them
        assert abs(memory["rss_bytes"] - rss_bytes(engine.proc.pid)) < 64 * 2**20
        assert pss_bytes(engine.proc.pid) is not None
        assert status["startup_s"]["structured outputs"] < 0.5  # the vocabulary waits
        # its packed weights are a file's pages: a second process mapping them takes half their
        # share of the PSS, and so half of what a park of the engine would release
        assert 0 < memory["weights_pss_bytes"] <= memory["weights_bytes"]
        packed = _packed_file(GEMMA_GGUF)
        assert packed is not None
        packed.populate()
        shared = _status(engine)["memory"]["weights_pss_bytes"]
        assert shared < memory["weights_pss_bytes"] - 0.3 * memory["weights_bytes"]
    finally:
        engine.stop()


def _status(engine: EngineProcess) -> dict:
    with urllib.request.urlopen(engine.url + "/status", timeout=30) as reply:
        return json.load(reply)


def _packed_file(gguf: Path) -> MappedFile | None:
    """The packed cache's file of ``gguf``'s engine, mapped by this process."""
    records = narrow_cache.cache_path(known_gguf_dir(gguf), "gguf")
    return open_mapped(packed_cache.cache_path(records, quant_gemm.library()))
