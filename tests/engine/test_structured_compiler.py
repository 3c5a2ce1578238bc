"""engine.structured on its own: constraints compile (or are refused with a 400 naming what is
wrong, at its schema path), the compile cache, matchers walking a grammar, and the bitmask
expansion against a bit-by-bit reference."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import torch

from engine.core.sampling_params import StructuredOutput
from engine.errors import InvalidRequestError
from engine.structured.bitmask import BitmaskApplier, allocate_bitmask
from engine.structured.compiler import CompileSettings, GrammarCompiler
from engine.structured.schema_check import keyword_paths


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    yield compiler
    compiler.shutdown()


def schema(value: object) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(value))


def reference_bias(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bit by bit: token t is allowed when bit t % 32 of word t // 32 is set."""
    bias = torch.full((bitmask.shape[0], vocab), float("-inf"))
    for row in range(bitmask.shape[0]):
        for token in range(vocab):
            if (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                bias[row, token] = 0.0
    return bias


def allowed(matcher, vocab: int) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill(bitmask, 0)
    return reference_bias(bitmask, vocab)[0] == 0


def walk(compiler: GrammarCompiler, tokenizer, constraint: StructuredOutput, text: str) -> bool:
    """Feed `text`'s tokens through a fresh matcher, each checked against the mask first; True
    if the grammar is then complete (it terminated, or allows the end token)."""
    matcher = compiler.compile(constraint).matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not allowed(matcher, len(tokenizer))[token]:
            return False
        assert matcher.accept(token), matcher.error
    return matcher.is_terminated or bool(allowed(matcher, len(tokenizer))[tokenizer.eos_token_id])


# ---- what compiles, and what a matcher allows ----


def test_schema_matcher_follows_the_schema(compiler, tokenizer) -> None:
    person = schema(
        {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 9}, "b": {"enum": ["x", "y"]}},
            "required": ["a", "b"],
            "additionalProperties": False,
        }
    )
    assert walk(compiler, tokenizer, person, '{"a": 5, "b": "y"}')
    assert not walk(compiler, tokenizer, person, '{"a": 50, "b": "y"}')  # above the maximum
    assert not walk(compiler, tokenizer, person, '{"a": 5, "b": "z"}')  # outside the enum
    assert not walk(compiler, tokenizer, person, '{"b": "y", "a": 5}')  # properties in order
    assert not walk(compiler, tokenizer, person, '{"a":5,"b":"y"}')  # json.dumps separators


@pytest.mark.parametrize(
    ("constraint", "good", "bad"),
    [
        (StructuredOutput("regex", r"\d{3}-[a-z]+"), "123-abc", "12-abc"),
        (StructuredOutput("choice", json.dumps(["yes", "no"])), "no", "maybe"),
        (StructuredOutput("grammar", 'start: "a" NUM\nNUM: /[0-9]+/'), "a42", "b42"),
        (StructuredOutput("grammar", 'root ::= "x" [0-9]'), "x7", "y7"),  # GBNF
        (StructuredOutput("json_object"), '{"k": [1, 2]}', "[1, 2]"),
    ],
)
def test_other_kinds(compiler, tokenizer, constraint, good, bad) -> None:
    assert walk(compiler, tokenizer, constraint, good)
    assert not walk(compiler, tokenizer, constraint, bad)


# ---- refusals: a 400 naming what is wrong ----


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        (schema({"type": "strin"}), "invalid at $.type"),
        (schema({"properties": {"a": {"minimum": "0"}}}), "invalid at $.properties.a.minimum"),
        (schema({"properties": {"a": {"not": {"type": "string"}}}}), "not (at $.properties.a.not)"),
        (
            schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
            "uniqueItems (at $.uniqueItems)",
        ),
        (schema({"if": {"type": "string"}, "then": {}}), "if, then (at $.if, $.then)"),
        (schema({"$ref": "#/$defs/missing"}), "/$defs/missing"),
        (schema({"type": "integer", "minimum": 5, "maximum": 1}), "minimum (5) is greater"),
        (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
        (StructuredOutput("json_schema", "[1]"), "must be an object or a boolean"),
        (StructuredOutput("regex", "(("), "unclosed group"),
        (StructuredOutput("grammar", "start: undefined_rule"), "unknown name"),
        (StructuredOutput("choice", "[]"), "non-empty array of strings"),
    ],
)
def test_refusals_name_the_problem(compiler, constraint, expected) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        compiler.compile(constraint)
    assert caught.value.status == 400 and caught.value.param == "response_format"
    assert expected in caught.value.message, caught.value.message


def test_keyword_paths_skip_property_names() -> None:
    """A property called "not" is a name, not the keyword."""
    tree = {"properties": {"not": {"type": "string"}, "b": {"not": {}}}, "$defs": {"if": {}}}
    assert list(keyword_paths(tree, {"not", "if"})) == ["$.properties.b.not"]


# ---- the cache ----


def test_cache_returns_the_same_compile(tokenizer) -> None:
    settings = CompileSettings(max_entries=2)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, settings)
    one, two, three = (schema({"type": "integer", "maximum": m}) for m in (1, 2, 3))
    first = compiler.compile(one)
    again = compiler.request(StructuredOutput("json_schema", one.value))  # keyed by value
    assert again.future.result() is first
    again.release()
    compiler.compile(two)
    compiler.compile(three)  # evicts `one`, the least recently used nobody holds
    assert compiler.compile(one) is not first
    compiler.shutdown()


def test_failures_are_cached_too(compiler) -> None:
    bad = schema({"type": "nope"})
    ticket = compiler.request(bad)
    with pytest.raises(InvalidRequestError):
        ticket.future.result(30)
    ticket.release()
    again = compiler.request(bad)
    assert again.future is ticket.future
    again.release()


def test_requests_do_not_wait_for_their_compile(compiler) -> None:
    started = time.monotonic()
    ticket = compiler.request(StructuredOutput("regex", "[a-c]{3}x"))
    assert time.monotonic() - started < 1 and not ticket.future.done()  # a worker compiles it
    assert ticket.future.result(30).matcher() is not None
    ticket.release()


def test_matchers_are_independent(compiler, tokenizer) -> None:
    grammar = compiler.compile(StructuredOutput("choice", json.dumps(["ab", "cd"])))
    first, second = grammar.matcher(), grammar.matcher()
    token = tokenizer.encode("ab", add_special_tokens=False)[0]
    assert first.accept(token) and first.num_tokens == 1
    assert second.num_tokens == 0  # the copy did not move
    other = tokenizer.encode("cd", add_special_tokens=False)[0]
    assert second.accept(other)


# ---- the bitmask ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_applier_masks_only_its_rows(dtype) -> None:
    vocab = 77  # not a multiple of 32: the last word is partial
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(4, vocab, generator=generator).to(dtype)
    before = scores.clone()
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)
    applier = BitmaskApplier()
    masked = applier.apply(scores, bitmask, [1, 3])
    assert torch.equal(scores, before)  # the input (the logprobs' logits) is left alone
    assert masked.dtype == dtype
    assert torch.equal(masked[[0, 2]], before[[0, 2]])
    expected = before[[1, 3]].float() + reference_bias(bitmask, vocab)
    assert torch.equal(masked[[1, 3]].float(), expected)
    # every row masked, and the buffers reused for another shape
    whole = applier.apply(scores[:2], bitmask, [0, 1])
    assert torch.equal(whole.float(), before[:2].float() + reference_bias(bitmask, vocab))
    one = applier.apply(scores[:1], bitmask[1:], [0])
    assert torch.equal(one.float(), before[:1].float() + reference_bias(bitmask[1:], vocab))
