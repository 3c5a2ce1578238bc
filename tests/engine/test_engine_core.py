"""EngineCore: validation, stop conditions, streamed deltas, aborts, KV sizing, and the CPU fast
path it loads (the modules on their own: test_cpu_linears.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.llm import LLM
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import RequestOutput
from engine.errors import CacheTooSmallError, InvalidRequestError
from engine.model.attention.backends import BACKEND_ENV, select_backend
from engine.model.cpu.linear import prepack_supported
from engine.model.kv_cache import KVCacheSpec, num_blocks_for_budget

PROMPT = [40, 41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module")
def core(tiny_llama_dir: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama_dir), num_threads=1, max_model_len=64))


def run(core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams):
    """Drive one request to the end; return its deltas."""
    core.add_request(request_id, prompt, params)
    deltas: list[RequestOutput] = []
    for _ in range(1000):
        deltas += [o for o in core.step() if o.request_id == request_id]
        if deltas and deltas[-1].finished:
            return deltas
    raise AssertionError("request did not finish")


def tokens_of(deltas: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for d in deltas for o in d.outputs if o.index == index for t in o.token_ids]


def text_of(deltas: list[RequestOutput], index: int = 0) -> str:
    return "".join(o.text for d in deltas for o in d.outputs if o.index == index)


def finish_of(deltas: list[RequestOutput], index: int = 0) -> str | None:
    reasons = [o.finish_reason for d in deltas for o in d.outputs if o.index == index]
    assert all(r is None for r in reasons[:-1])
    return reasons[-1]


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kwargs)


# ------------------------------------------------------------- the CPU fast path at load
def test_bf16_engine_runs_prepacked_and_lean(tiny_llama_dir: Path) -> None:
    """Where the CPU has bf16 GEMMs, a bf16 engine prepacks, fuses its norms and passes the lean
    forward's probe; its greedy tokens follow the fp32 engine's for the first steps."""
    if not prepack_supported(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no bf16 oneDNN on this CPU")
    config = {"model": str(tiny_llama_dir), "num_threads": 1, "max_model_len": 64}
    bf16 = EngineCore(EngineConfig(**config, dtype="bfloat16"))
    assert bf16.runner.cpu.num_prepacked > 0 and bf16.runner.num_fused_norms > 0
    assert bf16.runner.lean is not None
    fp32 = EngineCore(EngineConfig(**config, dtype="float32"))
    ours = tokens_of(run(bf16, "bf16", PROMPT, greedy(max_tokens=3)))
    reference = tokens_of(run(fp32, "fp32", PROMPT, greedy(max_tokens=3)))
    assert ours[:1] == reference[:1]


def test_attention_backend_is_chosen_once_at_load(
    tiny_llama_dir: Path, core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$MODELYARD_ATTENTION_BACKEND is read when the model loads, not by every attention call:
    changing it afterwards changes nothing, and the forced backend gives the same tokens."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert core.runner.attention_backend == select_backend(torch.device("cpu"))
    monkeypatch.setenv(BACKEND_ENV, "torch")
    forced = EngineCore(EngineConfig(model=str(tiny_llama_dir), num_threads=1, max_model_len=64))
    assert forced.runner.attention_backend == "torch"
    monkeypatch.setenv(BACKEND_ENV, "no-such-backend")
    ours = tokens_of(run(forced, "forced", PROMPT, greedy(max_tokens=4)))
    assert ours == tokens_of(run(core, "auto", PROMPT, greedy(max_tokens=4)))


def test_bf16_kv_cache_under_an_fp32_model(tiny_llama_dir: Path) -> None:
    """--kv-cache-dtype bfloat16: twice the blocks for the same budget, prefill (torch path) and
    decode (kernel or torch) read the narrower cache, tokens follow the fp32 cache's."""
    config = {"model": str(tiny_llama_dir), "num_threads": 1, "max_model_len": 64}
    narrow = EngineCore(EngineConfig(**config, kv_cache_dtype="bfloat16"))
    full = EngineCore(EngineConfig(**config))
    assert narrow.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert full.runner.kv_caches[0][0].dtype == torch.float32
    assert narrow.runner.num_blocks == 2 * full.runner.num_blocks
    prompts = [PROMPT, list(range(100, 140))]
    for i, prompt in enumerate(prompts):
        ours = tokens_of(run(narrow, f"n{i}", prompt, greedy(max_tokens=4)))
        reference = tokens_of(run(full, f"f{i}", prompt, greedy(max_tokens=4)))
        assert ours == reference


def test_engine_runs_prepacked_linears_on_cpu(core: EngineCore) -> None:
    # Per layer: fused qkv, o, fused gate/up, down; plus the lm_head.
    assert core.runner.cpu.num_prepacked == 2 * 4 + 1


# ----------------------------------------------------------------------- KV cache sizing
def test_kv_blocks_from_budget() -> None:
    spec = KVCacheSpec(
        num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert num_blocks_for_budget(spec, 100 * spec.bytes_per_block + 5, max_model_len=64) == 100
    with pytest.raises(CacheTooSmallError, match="needs 4"):
        num_blocks_for_budget(spec, 3 * spec.bytes_per_block, max_model_len=64)


def test_engine_refuses_a_cache_smaller_than_one_sequence(tiny_llama_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir), num_threads=1, max_model_len=1024, kv_cache_memory=64 * 2**10
    )
    with pytest.raises(CacheTooSmallError, match="max_model_len=1024"):
        EngineCore(config)


def test_max_model_len_capped_by_model(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_threads=1, max_model_len=100_000, kv_cache_memory=2**24)
    assert llm.engine.max_model_len == 1024  # the tiny model's max_position_embeddings


# -------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "empty"),
        ([5, 10**6], SamplingParams(), "out of the vocabulary"),
        ([-1], SamplingParams(), "out of the vocabulary"),
        ([5] * 60, SamplingParams(max_tokens=10), "maximum context length is 64.*70 tokens"),
        ([5] * 64, SamplingParams(max_tokens=None), "64 prompt tokens leave no room"),
    ],
)
def test_invalid_requests(core: EngineCore, prompt, params, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        core.add_request("bad", prompt, params)
    assert not core.has_unfinished()


def test_duplicate_request_id(core: EngineCore) -> None:
    core.add_request("dup", PROMPT, greedy(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        core.add_request("dup", PROMPT, greedy(max_tokens=2))
    while core.has_unfinished():
        core.step()


# ---------------------------------------------------------------------- stop conditions
def test_max_tokens_and_streamed_text(core: EngineCore) -> None:
    deltas = run(core, "len", PROMPT, greedy(max_tokens=12))
    tokens = tokens_of(deltas)
    assert len(tokens) == 12 and finish_of(deltas) == "length"
    assert text_of(deltas) == core.tokenizer.decode(tokens, skip_special_tokens=True)
    assert deltas[0].queue_time_s is not None and all(d.queue_time_s is None for d in deltas[1:])
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_fills_to_max_model_len_without_max_tokens(core: EngineCore) -> None:
    deltas = run(core, "fill", PROMPT, greedy(max_tokens=None))
    assert len(PROMPT) + len(tokens_of(deltas)) == core.max_model_len
    assert finish_of(deltas) == "length"


def test_stop_token_ids_and_eos(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    free_run = tokens_of(run(core, "free", PROMPT, greedy(max_tokens=20)))
    stop_at = free_run[5]
    cut = free_run.index(stop_at) + 1

    deltas = run(core, "stopid", PROMPT, greedy(max_tokens=20, stop_token_ids=[stop_at]))
    assert tokens_of(deltas) == free_run[:cut] and finish_of(deltas) == "stop"
    assert text_of(deltas) == core.tokenizer.decode(free_run[: cut - 1])  # stop token not shown

    monkeypatch.setattr(core, "eos_token_ids", frozenset({stop_at}))
    eos = run(core, "eos", PROMPT, SamplingParams(temperature=0.0, max_tokens=20))
    assert tokens_of(eos) == free_run[:cut] and finish_of(eos) == "stop"
    ignored = run(core, "ign", PROMPT, greedy(max_tokens=20))
    assert tokens_of(ignored) == free_run and finish_of(ignored) == "length"


def test_stop_string_cuts_text(core: EngineCore) -> None:
    free_run = run(core, "free-s", PROMPT, greedy(max_tokens=24))
    full_text = text_of(free_run)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    assert len(stop) == 3
    deltas = run(core, "stopstr", PROMPT, greedy(max_tokens=24, stop=[stop]))
    assert finish_of(deltas) == "stop"
    assert text_of(deltas) == full_text[: full_text.index(stop)]
    assert len(tokens_of(deltas)) < 24


def test_n_choices_stream_separately(core: EngineCore) -> None:
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=6, ignore_eos=True)
    deltas = run(core, "n3", PROMPT, params)
    for index in range(3):
        assert len(tokens_of(deltas, index)) == 6 and finish_of(deltas, index) == "length"
    assert len({tuple(tokens_of(deltas, i)) for i in range(3)}) > 1


# ------------------------------------------------------------------------ aborts, stats
def test_abort_frees_blocks_at_once(core: EngineCore) -> None:
    free_before = core.block_manager.num_free_blocks
    core.add_request("a", PROMPT * 4, greedy(max_tokens=30))
    core.add_request("b", PROMPT, greedy(max_tokens=3))
    core.step()
    core.step()
    assert core.block_manager.num_free_blocks < free_before
    core.abort("a")
    assert core.stats().num_running == 1
    deltas = []
    while core.has_unfinished():
        deltas += core.step()
    assert {d.request_id for d in deltas} == {"b"}
    assert core.block_manager.num_free_blocks == free_before
    core.abort("never-existed")


def test_n_above_max_n_is_refused(core: EngineCore) -> None:
    with pytest.raises(InvalidRequestError, match="n must be at most 128") as refused:
        core.add_request("n-big", PROMPT, greedy(n=129))
    assert refused.value.param == "n" and not core.has_unfinished()


@pytest.mark.parametrize("steps", [0, 1, 2])  # siblings waiting for the fork, forked, decoding
def test_abort_ends_every_choice_of_a_request(core: EngineCore, steps: int) -> None:
    free_before = core.block_manager.num_free_blocks
    core.add_request("n8", PROMPT, greedy(n=8, max_tokens=20))
    assert core.stats().num_waiting == 8
    for _ in range(steps):
        core.step()
    core.abort("n8")
    stats = core.stats()
    assert stats.num_running == stats.num_waiting == 0 and not core.has_unfinished()
    assert core.block_manager.num_free_blocks == free_before


def test_stats_count_tokens(core: EngineCore) -> None:
    before = core.stats()
    run(core, "s1", PROMPT, greedy(max_tokens=5))
    after = core.stats()
    assert after.prompt_tokens - before.prompt_tokens == len(PROMPT)
    assert after.generation_tokens - before.generation_tokens == 5
    assert after.num_running == after.num_waiting == 0
    assert after.kv_cache_usage == 0.0
    assert after.block_size == 16 and after.num_blocks > 0


# --------------------------------------------------------------------------- offline API
def test_llm_generate_and_chat(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [by_text] = llm.generate("Hello, world!", params)
    [by_ids] = llm.generate(llm.tokenizer("Hello, world!")["input_ids"], params)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids)
    assert by_text.outputs[0].finish_reason == "length"

    chats = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "你好，世界"}]]
    results = llm.chat(chats, params)
    assert [r.prompt.endswith("<|im_start|>assistant\n") for r in results] == [True, True]
    assert "你好，世界" in results[1].prompt
    [single] = llm.chat(chats[0], params)
    assert single.outputs[0].token_ids == results[0].outputs[0].token_ids

    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2], []], params)
    assert not llm.engine.has_unfinished()
