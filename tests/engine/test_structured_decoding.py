"""Constrained decoding through the engine core on the tiny random Llama: whatever the (random)
model prefers, the grammar forces outputs that parse and validate (checked with jsonschema, re, the
choices themselves). Also: n, logprobs of the raw model, stop strings, max_tokens, seeds,
preemption by recompute, the prefix cache, batches mixing free and constrained requests, and
requests waiting for their compile without holding up the others."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.llm import LLM
from engine.core.sampling import Sampler
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError
from tests.engine.test_engine_core import finish_of, run, text_of, tokens_of
from tests.engine.test_engine_correctness import random_prompts
from tests.engine.test_sampling import chi_square, reference_distribution

PROMPT = [40, 41, 42, 43, 44, 45, 46]
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {
                "type": "object",
                "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 999},
                "maxItems": 2,
            },
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    "enums_and_numbers": {
        "type": "object",
        "properties": {
            "role": {"enum": ["admin", "user", "guest"]},
            "level": {"type": "integer", "minimum": 3, "maximum": 7},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "active": {"type": "boolean"},
        },
        "required": ["role", "level", "ratio", "active"],
        "additionalProperties": False,
    },
    "optional_properties": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0}, "note": NAME},
        "required": ["id"],
        "additionalProperties": False,
    },
    "refs_and_defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/point"},
            "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
        },
        "required": ["start", "path"],
        "additionalProperties": False,
    },
    "top_level_array": {
        "type": "array",
        "items": {"enum": [1, 2, 3]},
        "minItems": 1,
        "maxItems": 4,
    },
}


@pytest.fixture(scope="module")
def core(tiny_llama_dir: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama_dir), num_threads=1, max_model_len=512))


def constrained(kind: str, value: object = "", **kwargs: object) -> SamplingParams:
    text = value if isinstance(value, str) else json.dumps(value)
    settings = {"temperature": 0.0, "max_tokens": 300, **kwargs}
    return SamplingParams(structured=StructuredOutput(kind, text), **settings)  # type: ignore[arg-type]


def schema_params(schema: dict, **kwargs: object) -> SamplingParams:
    return constrained("json_schema", schema, **kwargs)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}])
def test_schema_outputs_parse_and_validate(core, name, sampling) -> None:
    deltas = run(core, f"{name}-{sampling}", PROMPT, schema_params(SCHEMAS[name], **sampling))
    assert finish_of(deltas) == "stop"
    jsonschema.validate(json.loads(text_of(deltas)), SCHEMAS[name])


def test_unconstrained_model_does_not_produce_json(core) -> None:
    """The reference the tests above lean on: left alone, the random model writes no JSON."""
    deltas = run(core, "free", PROMPT, SamplingParams(temperature=0.0, max_tokens=40))
    with pytest.raises(json.JSONDecodeError):
        json.loads(text_of(deltas))


@pytest.mark.parametrize("seed", [0, 4])  # seeds whose object closes within max_tokens
def test_json_object(core, seed) -> None:
    params = constrained("json_object", max_tokens=400, temperature=1.0, seed=seed)
    deltas = run(core, f"object{seed}", PROMPT, params)
    assert finish_of(deltas) == "stop"
    assert isinstance(json.loads(text_of(deltas)), dict)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_regex(core, seed) -> None:
    pattern = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
    deltas = run(
        core, f"re{seed}", PROMPT, constrained("regex", pattern, temperature=1.0, seed=seed)
    )
    assert finish_of(deltas) == "stop"
    assert re.fullmatch(pattern, text_of(deltas))


def test_choice_ends_when_the_grammar_does(core) -> None:
    """ignore_eos: the sequence ends because the grammar cannot go on, not on an end token."""
    choices = ["quick brown", "lazy dog", "hello"]
    for seed in range(4):
        params = constrained("choice", choices, temperature=1.0, seed=seed, ignore_eos=True)
        deltas = run(core, f"choice{seed}", PROMPT, params)
        assert text_of(deltas) in choices and finish_of(deltas) == "stop"


@pytest.mark.parametrize(
    ("grammar", "pattern"),
    [
        ('start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/', r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)"),
        ('root ::= "x=" [0-9] [0-9]', r"x=[0-9][0-9]"),  # GBNF
    ],
)
def test_grammar(core, grammar, pattern) -> None:
    deltas = run(core, grammar, PROMPT, constrained("grammar", grammar, max_tokens=60))
    assert re.fullmatch(pattern, text_of(deltas)), text_of(deltas)


def test_n_choices_each_valid_with_own_matcher(core) -> None:
    schema = SCHEMAS["enums_and_numbers"]
    core.add_request("n3", PROMPT, schema_params(schema, n=3, temperature=1.0, seed=11))
    seqs = core._requests["n3"].seqs
    assert len({id(s.matcher) for s in seqs}) == 3
    deltas = []
    while not (deltas and deltas[-1].finished):
        deltas += [d for d in core.step() if d.request_id == "n3"]
    texts = [text_of(deltas, i) for i in range(3)]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # sampled apart, each on its own grammar state


def test_seeded_sampling_repeats(core) -> None:
    params = schema_params(SCHEMAS["array_bounds"], temperature=1.0, seed=42)
    first = tokens_of(run(core, "seed-a", PROMPT, params))
    assert tokens_of(run(core, "seed-b", PROMPT, params)) == first


def test_max_tokens_cuts_with_length(core) -> None:
    deltas = run(core, "short", PROMPT, schema_params(SCHEMAS["nested_object"], max_tokens=3))
    assert finish_of(deltas) == "length" and len(tokens_of(deltas)) == 3


def test_stop_string_cuts_the_output(core) -> None:
    params = constrained("choice", ["alpha beta"], stop=[" "])
    deltas = run(core, "stop", PROMPT, params)
    assert text_of(deltas) == "alpha" and finish_of(deltas) == "stop"


def test_logprobs_are_the_raw_model_distribution(core, tiny_llama_dir) -> None:
    """The chosen tokens are forced, but their logprobs (and the alternatives) are what the
    unconstrained model predicted: compared with transformers' forward over the same tokens."""
    params = constrained("regex", "[0-9]{4}", logprobs=3)
    deltas = run(core, "logprobs", PROMPT, params)
    tokens = tokens_of(deltas)
    logprobs = [lp for d in deltas for o in d.outputs for lp in o.logprobs]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    reference = torch.log_softmax(logits, dim=-1)
    for step, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(reference[step, token].item(), abs=1e-4)
        top_ids = reference[step].topk(3).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
    assert re.fullmatch("[0-9]{4}", text_of(deltas))
    assert any(lp.top[0][0] != lp.token_id for lp in logprobs)  # the grammar overrode the model


def test_mixed_batch_leaves_free_requests_unchanged(core) -> None:
    """Greedy free requests get exactly the tokens they get alone when constrained requests
    share their batch (the mask touches only the constrained rows)."""
    free_prompts = random_prompts([5, 12, 30], seed=4)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [tokens_of(run(core, f"alone{i}", p, free)) for i, p in enumerate(free_prompts)]
    for i, prompt in enumerate(free_prompts):
        core.add_request(f"mixed{i}", prompt, free)
        core.add_request(f"constrained{i}", prompt, schema_params(SCHEMAS["array_bounds"]))
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert [outputs[f"mixed{i}"] for i in range(3)] == alone


def _block_bytes(model_dir: Path) -> int:
    config = AutoConfig.from_pretrained(model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * head_dim * 4


def test_preemption_keeps_the_matcher_in_step(tiny_llama_dir) -> None:
    """A pool of 10 blocks for 8 constrained sequences: preempted sequences are recomputed with
    their output kept, and their matcher with it: the outputs are those of an ample cache."""
    prompts = random_prompts([20, 9, 25, 14, 30, 6, 18, 11], seed=9)
    params = schema_params(SCHEMAS["array_bounds"], max_tokens=80)
    ample = LLM(str(tiny_llama_dir), num_threads=1, max_model_len=128)
    expected = [r.outputs[0].token_ids for r in ample.generate(prompts, params)]
    small = LLM(
        str(tiny_llama_dir),
        num_threads=1,
        max_model_len=128,
        kv_cache_memory=10 * _block_bytes(tiny_llama_dir),
    )
    results = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    assert [r.outputs[0].token_ids for r in results] == expected
    for result in results:
        jsonschema.validate(json.loads(result.outputs[0].text), SCHEMAS["array_bounds"])


def test_prefix_cache_hit_changes_nothing(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), num_threads=1, max_model_len=256)
    prompt = random_prompts([40], seed=2)[0]  # two full blocks to share
    params = schema_params(SCHEMAS["refs_and_defs"], max_tokens=150)
    first = llm.generate([prompt], params)[0].outputs[0]
    second = llm.generate([prompt], params)[0]
    assert second.num_cached_tokens >= 32
    assert second.outputs[0].token_ids == first.token_ids
    jsonschema.validate(json.loads(first.text), SCHEMAS["refs_and_defs"])


# ---- compiles off the step loop ----


@pytest.fixture
def held_compiles(core, monkeypatch) -> Iterator[threading.Event]:
    """Compiles started from here on wait until the returned event is set."""
    gate = threading.Event()
    real = core.grammars._compile

    def held(worker, entry):
        gate.wait(30)
        return real(worker, entry)

    monkeypatch.setattr(core.grammars, "_compile", held)
    yield gate
    gate.set()


def test_a_compiling_request_waits_without_holding_up_others(core, held_compiles) -> None:
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 77},
        "maxItems": 2,
    }
    core.add_request("waits", PROMPT, schema_params(schema))
    assert core.stats().num_waiting == 1
    free = run(core, "goes-ahead", PROMPT, SamplingParams(temperature=0.0, max_tokens=5))
    assert finish_of(free) == "length"  # finished while the other's grammar was compiling
    assert core._requests["waits"].seqs[0].num_output_tokens == 0
    held_compiles.set()
    deltas = []
    for _ in range(1000):
        deltas += [d for d in core.step() if d.request_id == "waits"]
        if deltas and deltas[-1].finished:
            break
    jsonschema.validate(json.loads(text_of(deltas)), schema)


def test_a_failed_compile_refuses_the_request(core) -> None:
    bad = schema_params({"type": "object", "properties": {"a": {"not": {}}}})
    with pytest.raises(InvalidRequestError, match="does not support"):
        core.grammars.compile(bad.structured)
    with pytest.raises(InvalidRequestError, match=r"\$\.properties\.a\.not"):
        core.add_request("refused", PROMPT, bad)  # compiled (and failed) before: refused now
    assert "refused" not in core._requests


def test_a_compile_failing_while_waiting_ends_with_its_error(core, held_compiles) -> None:
    core.add_request("refused", PROMPT, schema_params({"type": "strin"}))
    held_compiles.set()
    deltas = []
    for _ in range(200):
        deltas += core.step()
        if deltas:
            break
    assert [d.request_id for d in deltas] == ["refused"] and deltas[0].finished
    assert isinstance(deltas[0].error, InvalidRequestError) and not core.has_unfinished()
    assert "$.type" in deltas[0].error.message


# ---- the sampler on constrained rows ----


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 8},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.05},
    ],
)
def test_sampler_draws_from_the_masked_distribution(core, settings) -> None:
    """Seeded draws of many constrained rows follow the textbook distribution of the logits with
    the grammar's disallowed tokens removed (chi-square), and never leave the allowed set."""
    compiled = core.grammars.compile(StructuredOutput("regex", "[0-9]"))
    vocab = core.vocab_size
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 3
    digits = [core.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    masked = torch.full((vocab,), float("-inf"))
    masked[digits] = logits[digits]
    expected = reference_distribution(masked, **settings)
    seqs = []
    for seed in range(4000):
        seq = Sequence(seed, "r", PROMPT, SamplingParams(seed=seed, **settings))
        seq.matcher = compiled.matcher()
        seqs.append(seq)
    tokens, _ = Sampler()(logits.expand(len(seqs), -1).contiguous(), seqs)
    dof = int((expected > 0).sum()) - 1
    assert chi_square(tokens, expected) < dof + 6 * dof**0.5 + 10  # seeded: no flakiness
