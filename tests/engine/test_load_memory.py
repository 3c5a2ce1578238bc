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

import pytest

from common.processes import pss_bytes, rss_bytes
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
        with urllib.request.urlopen(engine.url + "/status", timeout=30) as reply:
            status = json.load(reply)
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
    finally:
        engine.stop()
