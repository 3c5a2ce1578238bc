"""Gemma 3 (the fleet's second model, Gemma 3 270M) on a tiny random model of its shape: greedy
output token-identical to transformers generate() with prompts past the sliding window, the C
decode kernel at head_dim 256 with one KV head, and the lean forward running it (its step-by-step
logits against the transformers path: test_lean_forward).

The real 270M model is checked by hand (docs/OPERATIONS.md); it is too slow for the suite.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.llm import LLM
from engine.model.cpu.kernels import build, paged_decode
from engine.model.cpu.lean_forward import LeanLlamaForward
from engine.model.step_batch import StepBatch
from scripts.tiny_models import GEMMA3_SLIDING_WINDOW, build_tiny_gemma3
from tests.engine.test_cpu_decode_kernel import decode_batch, naive_decode
from tests.engine.test_engine_correctness import (
    engine_tokens,
    greedy,
    random_prompts,
    reference_greedy,
)

# Past the window of 12 from the prompt on (40, 63) or only while decoding (5 + 16 new tokens).
PROMPT_LENS = [40, 3, 17, 63, 1, 12, 5, 29]
MAX_NEW = 16


@pytest.fixture(scope="module")
def gemma3_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list]:
    """(model dir, prompts, transformers' greedy continuations), computed once."""
    model_dir = build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))
    prompts = random_prompts(PROMPT_LENS, seed=11)
    return model_dir, prompts, reference_greedy(model_dir, prompts, MAX_NEW)


def test_tiny_gemma3_has_the_270m_shape(gemma3_case) -> None:
    model_dir, _, _ = gemma3_case
    core = EngineCore(EngineConfig(model=str(model_dir), num_threads=1, max_model_len=128))
    loaded = core.runner.loaded
    assert (loaded.head_dim, loaded.num_kv_heads, loaded.num_layers) == (256, 1, 3)
    windows = [layer.self_attn.sliding_window for layer in core.runner.model.model.layers]
    assert windows == [GEMMA3_SLIDING_WINDOW, GEMMA3_SLIDING_WINDOW, None]
    lean = core.runner.lean  # the lean forward runs it: each layer its window and rotary table
    assert lean is not None
    assert [layer.sliding_window for layer in lean.layers] == windows
    local, _, global_ = (layer.rope for layer in lean.layers)
    assert [layer.rope for layer in lean.layers] == [local, local, global_] and local != global_


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_model_len": 256},
        # prefill chunks of 16 tokens: later chunks attend to the window through the cache
        {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    ],
    ids=["batched", "chunked-prefill"],
)
def test_greedy_matches_transformers(
    gemma3_case, engine_args: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, prompts, expected = gemma3_case
    windows: list[int | None] = []  # the window of every decode call of the C kernel
    kernel = paged_decode.paged_decode_attention

    def spy(*args, **kwargs):
        windows.append(args[6])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(paged_decode, "paged_decode_attention", spy)
    llm = LLM(str(model_dir), num_threads=1, **engine_args)
    assert engine_tokens(llm, prompts, greedy(MAX_NEW)) == expected
    if llm.engine.runner.attention_backend == "cpu":  # decodes ran on the kernel, both layer kinds
        assert set(windows) == {GEMMA3_SLIDING_WINDOW, None}


def test_lean_forward_declines_gemma3_labelled_llama(
    gemma3_case, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the model_type, the structure itself keeps the Llama family's op sequence off Gemma:
    its scaled embedding, then (with a plain one) its extra feed-forward norms, each logged."""
    model_dir, _, _ = gemma3_case
    core = EngineCore(EngineConfig(model=str(model_dir), num_threads=1, max_model_len=128))
    model = core.runner.model
    model.config.model_type = "llama"
    with caplog.at_level(logging.INFO, logger="engine.model.cpu.lean_forward"):
        assert LeanLlamaForward.build(model) is None
        assert "embedding Gemma3TextScaledWordEmbedding is not a plain lookup" in caplog.text
        model.model.embed_tokens = nn.Embedding(*model.model.embed_tokens.weight.shape)
        assert LeanLlamaForward.build(model) is None
        assert "layer 0 (Gemma3DecoderLayer): submodules" in caplog.text


def test_an_attention_soft_cap_in_the_config_is_ignored_as_transformers_does(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_gemma3(tmp_path, attn_logit_softcapping=20.0)
    config = EngineConfig(
        model=str(model_dir), num_threads=1, max_model_len=128, kv_cache_memory=8 * 2**20
    )
    core = EngineCore(config)
    prompt = random_prompts([40], seed=5)[0]
    step = StepBatch(prompt, list(range(40)), [40], [40], [[0, 1, 2]], [39])
    logits = core.runner.execute(step)[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert core.runner.lean is not None


@pytest.mark.skipif(not build.available(), reason="no C compiler: the kernel cannot be built here")
@pytest.mark.parametrize("window", [None, 512, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_at_gemma3_270m_shape(window: int | None, dtype: torch.dtype) -> None:
    """4 query heads on 1 KV head of 256 dims, contexts up to 600 (past the 512 window)."""
    batch = decode_batch(q_heads=4, kv_heads=1, head_dim=256)
    k_cache, v_cache = batch.k_cache.to(dtype), batch.v_cache.to(dtype)
    query = batch.query.to(dtype)
    out = paged_decode.paged_decode_attention(
        query, k_cache, v_cache, batch.meta.block_tables, batch.meta.seq_lens,
        256**-0.5, window, None, 2,
    )  # fmt: skip
    batch.query, batch.k_cache, batch.v_cache = query.float(), k_cache.float(), v_cache.float()
    expected = naive_decode(batch, 256**-0.5, window, None)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
