"""Narrow weights keep SmolLM2-135M's predictions: perplexity and top-1 agreement with the fp32
model over 2,048 tokens of a fixed text (the Apache License 2.0, tests/data/apache-2.0.txt).

The fp32 model is the GGUF's Q4_1 weights dequantised (the file is all there is), so ``auto``
(the file's own blocks) differs from it only by the GEMMs' int8 activations, and ``int8``
requantises those fp32 weights. Bounds, from the measurements on 2026-12-02
(docs/PERFORMANCE.md#narrow-weights): perplexity within 1 % (int8; measured +0.4 %) and 5 %
(4-bit; measured -0.2 %) of fp32's; top-1 agreement at least 95 % for the file's own 4-bit blocks
(measured 95.7 %) and 94 % for int8 (measured 95.1 %: its weights are rounded a second time, on
top of the activations), a margin of ~20 of the 2,047 positions for other CPUs' fp32 roundings.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.model.cpu.fast_path import prepare_cpu_fast_path
from engine.model.loader import load_model
from tests.conftest import SMOLLM2_GGUF

TEXT = Path(__file__).resolve().parent.parent / "data" / "apache-2.0.txt"
TOKENS = 2048
WINDOW = 512  # tokens per forward; each window is scored on its own context
BOUNDS = {"int8": 0.01, "auto": 0.05, "int4": 0.05}  # relative perplexity increase allowed
MIN_TOP1 = {"int8": 0.94, "auto": 0.95, "int4": 0.95}

pytestmark = pytest.mark.skipif(not SMOLLM2_GGUF.exists(), reason="SmolLM2 GGUF not fetched")


def _scores(quantization: str) -> tuple[float, torch.Tensor]:
    """(perplexity, argmax per position) of the model under ``quantization``."""
    config = EngineConfig(model=str(SMOLLM2_GGUF), quantization=quantization, num_threads=2)
    loaded = load_model(config)
    fast = prepare_cpu_fast_path(loaded, config)
    assert (fast.narrow is None) == (quantization == "none")
    ids = torch.tensor(loaded.tokenizer(TEXT.read_text()).input_ids[:TOKENS])
    assert len(ids) == TOKENS
    nll, predictions = 0.0, []
    with torch.inference_mode():
        for start in range(0, TOKENS, WINDOW):
            window = ids[start : start + WINDOW]
            logits = loaded.model(input_ids=window[None], use_cache=False).logits[0].float()
            nll += torch.nn.functional.cross_entropy(logits[:-1], window[1:], reduction="sum")
            predictions.append(logits[:-1].argmax(-1))
    return math.exp(nll / (TOKENS - TOKENS // WINDOW)), torch.cat(predictions)


@pytest.fixture(scope="module")
def dense() -> tuple[float, torch.Tensor]:
    return _scores("none")


@pytest.mark.parametrize("quantization", ["int8", "auto", "int4"])
def test_narrow_weights_keep_perplexity_and_top1(dense, quantization):
    dense_ppl, dense_top1 = dense
    ppl, top1 = _scores(quantization)
    agreement = (top1 == dense_top1).float().mean().item()
    print(f"{quantization}: perplexity {ppl:.3f} vs fp32 {dense_ppl:.3f}, top-1 {agreement:.3f}")
    assert ppl <= dense_ppl * (1 + BOUNDS[quantization])
    assert agreement >= MIN_TOP1[quantization]
