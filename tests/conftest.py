"""Shared fixtures: tiny local models (built once per test session), the real SmolLM2 file, and
a redis-server of the test's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from scripts.redis_server import RedisServer
from scripts.tiny_models import build_tiny_llama, build_tiny_sliding, build_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_GGUF = REPO_ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny byte-level BPE tokenizer (FakeCore's, and the tiny models')."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_sliding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_sliding(tmp_path_factory.mktemp("tiny-sliding"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    if not SMOLLM2_GGUF.exists():
        pytest.fail(f"{SMOLLM2_GGUF} missing: run `make test` (it fetches the model) first")
    return SMOLLM2_GGUF


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server on a free loopback port, no persistence, killed by PID afterwards; a test
    may ``kill()`` it and ``start()`` it again on the same port."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield server
    server.kill()
