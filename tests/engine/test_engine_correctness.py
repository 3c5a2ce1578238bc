"""The engine's greedy output is token-identical to transformers generate(), prompt by prompt.

The reference runs each prompt alone through `generate(do_sample=False)` (no padding effects); the
engine runs all 16 prompts together, under the batching conditions each test sets up: ample cache,
a cache so small that sequences get preempted, a token budget so small that prefills are chunked,
and prompts sharing a prefix so that the prefix cache serves blocks.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.core.llm import LLM
from engine.core.sampling_params import SamplingParams

PROMPT_LENS = [3, 17, 5, 40, 1, 9, 26, 12]
SHARED_PREFIX_LEN = 33  # two full blocks of 16 and one token
TAIL_LENS = [2, 21, 7, 30, 15, 1, 11, 24]
MAX_NEW = 16
TINY_ARCHS = ["tiny_llama_dir", "tiny_sliding_dir"]


def random_prompts(lens: list[int], seed: int, low: int = 3, high: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n in lens]


def mixed_prompts() -> list[list[int]]:
    """16 prompts of 1..63 tokens; the last 8 share a prefix (prefix-cache material)."""
    shared = random_prompts([SHARED_PREFIX_LEN], seed=7)[0]
    tails = random_prompts(TAIL_LENS, seed=8)
    return random_prompts(PROMPT_LENS, seed=1) + [shared + tail for tail in tails]


def reference_greedy(
    model_dir: Path, prompts: list[list[int]], max_new: int, gguf_file: str | None = None
) -> list[list[int]]:
    """transformers generate(), greedy, one prompt at a time (no padding effects)."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf_file, dtype=torch.float32
    ).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def engine_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


def greedy(max_tokens: int = MAX_NEW, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny_case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(model dir, prompts, reference continuations) per tiny architecture, computed once."""
    model_dir = request.getfixturevalue(request.param)
    prompts = mixed_prompts()
    return model_dir, prompts, reference_greedy(model_dir, prompts, MAX_NEW)


def test_greedy_matches_transformers(tiny_case) -> None:
    model_dir, prompts, expected = tiny_case
    llm = LLM(str(model_dir), num_threads=1, max_model_len=256)
    assert engine_tokens(llm, prompts, greedy()) == expected


def test_greedy_matches_under_preemption(tiny_case) -> None:
    model_dir, prompts, expected = tiny_case
    # A pool of 12 blocks (192 tokens) while 16 sequences of up to 79 tokens run.
    config = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bytes_per_block = 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * head_dim * 4
    small = LLM(
        str(model_dir), num_threads=1, max_model_len=96, kv_cache_memory=12 * bytes_per_block
    )
    assert small.engine.stats().num_blocks == 12
    assert engine_tokens(small, prompts, greedy()) == expected
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == 12  # everything came back


def test_greedy_matches_with_chunked_prefill(tiny_case) -> None:
    model_dir, prompts, expected = tiny_case
    llm = LLM(str(model_dir), num_threads=1, max_num_batched_tokens=16, max_num_seqs=4)
    chunk_sizes: list[int] = []
    execute = llm.engine.runner.execute

    def spy(batch):  # record every prefill chunk the scheduler hands to the runner
        chunk_sizes.extend(n for n in batch.query_lens if n > 1)  # one per scheduled sequence
        assert sum(batch.query_lens) <= 16 and len(batch.query_lens) <= 4
        return execute(batch)

    llm.engine.runner.execute = spy
    assert engine_tokens(llm, prompts, greedy()) == expected
    assert max(chunk_sizes) <= 16 < max(len(p) for p in prompts)


def test_greedy_matches_with_prefix_cache_hits(tiny_case) -> None:
    model_dir, prompts, expected = tiny_case
    llm = LLM(str(model_dir), num_threads=1, max_model_len=256)
    first_shared = len(PROMPT_LENS)
    warm = engine_tokens(llm, prompts[first_shared : first_shared + 1], greedy())
    assert llm.engine.stats().prefix_cache_hits == 0
    outputs = engine_tokens(llm, prompts, greedy())
    # Each later prompt with the shared prefix finds its two full blocks cached.
    assert llm.engine.stats().prefix_cache_hits >= (len(TAIL_LENS)) * 32
    assert warm == expected[first_shared : first_shared + 1]
    assert outputs == expected


def test_n_greedy_choices_share_prompt_and_match(tiny_llama_dir) -> None:
    prompts = random_prompts([21, 6, 35], seed=3)  # 21 and 35: partial last block -> copy-on-write
    expected = reference_greedy(tiny_llama_dir, prompts, 10)
    llm = LLM(str(tiny_llama_dir), num_threads=1)
    results = llm.generate(prompts, greedy(10, n=3))
    for result, want in zip(results, expected, strict=True):
        assert [c.token_ids for c in result.outputs] == [want] * 3
    assert llm.engine.block_manager.num_free_blocks == llm.engine.stats().num_blocks


def test_seeded_sampling_reproducible_across_runs_and_batches(tiny_llama_dir) -> None:
    prompts = random_prompts([9, 23, 4, 31], seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, n=2)
    llm = LLM(str(tiny_llama_dir), num_threads=1)

    def choices(results):
        return [[c.token_ids for c in r.outputs] for r in results]

    alone = choices(llm.generate(prompts[:1], seeded))
    again = choices(llm.generate(prompts[:1], seeded))
    # Same request, now batched after other prompts with their own (unseeded) sampling.
    others = SamplingParams(temperature=1.0, max_tokens=16)
    for i, prompt in enumerate(prompts[1:]):
        llm.engine.add_request(f"other-{i}", prompt, others)
    mixed = choices(llm.generate(prompts[:1], seeded))
    while llm.engine.has_unfinished():
        llm.engine.step()
    fresh = choices(LLM(str(tiny_llama_dir), num_threads=1).generate(prompts[:1], seeded))
    assert alone == again == mixed == fresh
    assert alone[0][0] != alone[0][1]  # the two choices draw differently


@pytest.fixture
def one_thread():
    """Both sides on one thread: on a shared 2-core machine a second thread mostly waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.smollm2
@pytest.mark.timeout(900)
def test_smollm2_greedy_matches_transformers(smollm2_gguf: Path, one_thread: None) -> None:
    # the dense engine against transformers; narrow weights: test_narrow_quality.py
    llm = LLM(
        str(smollm2_gguf), num_threads=1, dtype="float32", quantization="none", max_model_len=512
    )
    topics = [
        "the moon",
        "paged attention",
        "bread",
        "rivers",
        "a short poem about cats",
        "why the sky is blue",
        "Python lists",
        "the number seven",
    ]
    messages = [
        [{"role": "user", "content": ("Tell me about " + topic + ". ") * (1 + i % 4)}]
        for i, topic in enumerate(topics)
    ]
    prompts = [
        llm.tokenizer(
            llm.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for m in messages
    ]
    expected = reference_greedy(smollm2_gguf.parent, prompts, MAX_NEW, smollm2_gguf.name)
    assert engine_tokens(llm, prompts, greedy()) == expected
