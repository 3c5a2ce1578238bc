"""Shared fixtures: tiny local models (built once per test session) and the real SmolLM2 file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
