"""Constraints compiled where they cannot hurt the engine (engine.structured): the static limits
refuse the shapes that crashed, stalled or bloated it, each naming its limit; a worker that
crashes or overruns its time is a 400 and the next compile works; a compile nobody waits for is
cancelled; the grammar cache stays within its byte budget; the probe walk refuses a grammar the
library gives up on before any generation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import llguidance
import pytest

from engine.core.sampling_params import StructuredOutput
from engine.errors import InvalidRequestError, ServiceUnavailableError
from engine.serving.tools.constraint import forced_call_constraint
from engine.serving.tools.request import parse_tool_request
from engine.structured import workers
from engine.structured.bitmask import allocate_bitmask
from engine.structured.compiler import CompileSettings, GrammarCompiler
from engine.structured.grammars import JSON_OPTIONS
from engine.structured.limits import ConstraintLimits, check_constraint
from engine.structured.matcher import GrammarMatcher
from engine.structured.workers import WorkerState
from tests.engine.pathological import (
    lark_chain,
    nested_branches,
    object_branches,
    pattern_properties,
    ref_chain,
    repetition_bomb,
    tool_with,
)

pytestmark = pytest.mark.timeout(120)

LIMITS = ConstraintLimits()
# No static limit: what reaches the worker is then up to it alone.
UNLIMITED = ConstraintLimits(*(10**9 for _ in range(7)))


def schema(value: object) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(value))


def refusal(constraint: StructuredOutput, limits: ConstraintLimits = LIMITS) -> str:
    parsed = json.loads(constraint.value) if constraint.kind == "json_schema" else None
    with pytest.raises(InvalidRequestError) as caught:
        check_constraint(constraint.kind, constraint.value, parsed, limits)
    assert caught.value.code == "grammar_too_complex"
    return caught.value.message


@pytest.fixture
def make(tokenizer) -> Iterator:
    made: list[GrammarCompiler] = []

    def build(**settings: object) -> GrammarCompiler:
        compiler = GrammarCompiler(
            tokenizer, len(tokenizer), {tokenizer.eos_token_id}, CompileSettings(**settings)
        )
        made.append(compiler)
        return compiler

    yield build
    for compiler in made:
        compiler.shutdown()


def compile_error(compiler: GrammarCompiler, constraint: StructuredOutput) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        compiler.compile(constraint)
    return caught.value


# ---- static limits: each finding's shape, refused before any compile ----


def test_a_deep_ref_chain_is_refused_naming_the_depth_limit() -> None:
    assert "max_depth" in refusal(schema(ref_chain(3000)))  # 106 KB: segfaulted the engine
    assert "65" in refusal(schema(ref_chain(LIMITS.max_depth)))  # the root is one level more
    check_constraint("json_schema", "", ref_chain(LIMITS.max_depth - 2), LIMITS)


def test_recursive_schemas_are_not_deep() -> None:
    tree = {
        "$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
        }}},
        "$ref": "#/$defs/node",
    }  # fmt: skip
    check_constraint("json_schema", json.dumps(tree), tree, LIMITS)


def test_chained_grammar_rules_are_refused() -> None:
    assert "max_grammar_rules" in refusal(StructuredOutput("grammar", lark_chain(3000)))
    nested = "start: " + "(" * 100 + '"a"' + ")" * 100
    assert "bracket nesting" in refusal(StructuredOutput("grammar", nested))
    check_constraint("grammar", 'start: NUM ("+" NUM)*\nNUM: /[0-9]+/', None, LIMITS)


def test_a_forced_tool_call_with_a_deep_ref_chain_is_refused() -> None:
    body = {"tools": [tool_with(ref_chain(2500))], "tool_choice": "required"}
    constraint = forced_call_constraint(parse_tool_request(body))
    assert constraint is not None
    assert "max_depth" in refusal(constraint)


def test_wide_schemas_are_refused() -> None:
    assert "max_pattern_properties" in refusal(schema(pattern_properties(500)))
    assert "max_branches" in refusal(schema(object_branches(LIMITS.max_branches + 1)))
    too_many = {"type": "object", "properties": {f"k{i}": {} for i in range(1001)}}
    assert "max_properties" in refusal(schema(too_many))


def test_nested_counted_repetitions_are_refused() -> None:
    assert "max_repetition" in refusal(StructuredOutput("regex", repetition_bomb(1)))
    pattern = {"type": "string", "pattern": "^(x{200}){200}$"}
    assert "max_repetition" in refusal(schema({"properties": {"a": pattern}}))
    deep = "(" * 65 + "a" + ")" * 65
    assert "max_depth" in refusal(StructuredOutput("regex", deep))
    for fine in (r".{0,100000}", r"\d{3}-[a-z]{2,5}(\.[a-z]{2,4}){1,3}", r"[({]{9}\({5}"):
        check_constraint("regex", fine, None, LIMITS)


def test_a_constraint_over_the_size_limit_is_refused_without_a_worker(make) -> None:
    compiler = make()
    with pytest.raises(InvalidRequestError, match="max_bytes") as caught:
        compiler.request(schema(object_branches(5000)))  # 598 KB: stalled plain requests
    assert caught.value.code == "grammar_too_complex"
    assert compiler.stats().compiles == {} and compiler._threads == []


def test_static_refusals_come_from_the_worker_as_400s(make) -> None:
    compiler = make()
    error = compile_error(compiler, StructuredOutput("grammar", lark_chain(3000)))
    assert error.code == "grammar_too_complex" and "max_grammar_rules" in error.message


# ---- the worker: crashes and overruns cost a compile, never the engine ----


def test_a_crashing_compile_is_a_400_and_the_next_one_works(make, monkeypatch) -> None:
    # A small worker stack makes a 400-deep chain crash it as 3,000 crashed the engine's.
    monkeypatch.setattr(workers, "WORKER_STACK_BYTES", 256 * 1024)
    compiler = make(limits=UNLIMITED)
    for crasher in (schema(ref_chain(400)), StructuredOutput("grammar", lark_chain(400))):
        error = compile_error(compiler, crasher)
        assert error.code == "grammar_too_complex"
        assert "crashed" in error.message and "SIGSEGV" in error.message
    assert compiler.compile(schema(ref_chain(40))).matcher() is not None


def test_a_compile_past_its_time_is_a_400_and_the_next_one_works(make) -> None:
    compiler = make(timeout_s=0.5)
    started = time.monotonic()
    error = compile_error(compiler, schema(nested_branches(50)))  # seconds, within every limit
    assert error.code == "grammar_too_complex"
    assert "within 0.5 s" in error.message and "--structured-compile-timeout" in error.message
    assert time.monotonic() - started < 30  # the kill, not the compile's end
    assert compiler.compile(StructuredOutput("regex", "[0-9]{3}")).matcher() is not None
    assert compiler.stats().compiles == {"grammar_too_complex": 1, "ok": 1}


def test_a_compile_nobody_waits_for_is_cancelled(make) -> None:
    compiler = make(timeout_s=60)
    ticket = compiler.request(schema(nested_branches(50)))
    worker = compiler._workers[0]
    for _ in range(300):  # bounded: until the worker has it
        if worker.state is WorkerState.BUSY:
            break
        time.sleep(0.05)
    assert worker.state is WorkerState.BUSY
    ticket.release()  # its client went away
    assert ticket.future.cancelled()
    for _ in range(100):
        if worker.state is WorkerState.STOPPED:
            break
        time.sleep(0.05)
    assert worker.state is WorkerState.STOPPED  # killed, not left compiling for a minute
    assert compiler.compile(StructuredOutput("regex", "ok")).matcher() is not None
    assert compiler.stats().compiles == {"cancelled": 1, "ok": 1}


def test_a_held_compile_is_not_cancelled_by_another_holder_leaving(make) -> None:
    compiler = make()
    constraint = StructuredOutput("regex", "[a-f]{4}")
    first, second = compiler.request(constraint), compiler.request(constraint)
    first.release()
    assert second.future.result(30).matcher() is not None
    second.release()


def test_the_probe_refuses_what_the_library_gives_up_on(make) -> None:
    compiler = make()
    # Within every static limit, but 600 optional properties put 2,407 items in an Earley row,
    # past llguidance's 2,000, at the first token: the kind of grammar that once ended requests
    # with a 200 whose output was `{"`.
    wide = {"type": "object", "properties": {f"key{i}": {"type": "integer"} for i in range(600)}}
    error = compile_error(compiler, schema(wide))
    assert error.code == "grammar_too_complex" and "after 0 tokens" in error.message


def test_the_probe_refuses_a_grammar_that_dead_ends(make) -> None:
    """`a` is itself all the way down: after `{"a": ` nothing can follow, and nothing is complete
    (it once answered 200 "stop" with that much)."""
    endless = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
    error = compile_error(make(), schema(endless))
    assert error.code == "grammar_dead_end" and "allows no token" in error.message


def test_a_matcher_at_a_dead_end_refuses_even_the_end_token(tokenizer) -> None:
    """What the core sees at run time, should the probe's walk not have gone there: llguidance
    allows only the end token there, which once finished such a request "stop" with `{"a": `;
    taking it must not count as complete (the core then ends the request with
    grammar_dead_end)."""
    eos = tokenizer.eos_token_id
    ll_tokenizer = llguidance.LLTokenizer(
        tokenizer.backend_tokenizer.to_str(), n_vocab=len(tokenizer), eos_token=[eos]
    )
    endless = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(endless), defaults=JSON_OPTIONS
    )
    matcher = GrammarMatcher(llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0))
    assert all(matcher.accept(t) for t in tokenizer.encode('{"a": ', add_special_tokens=False))
    mask = allocate_bitmask(1, len(tokenizer))
    matcher.fill(mask, 0)
    assert mask.nonzero().tolist() == [[0, eos // 32]] and int(mask[0, eos // 32]) == 1 << eos
    assert not matcher.accept(eos)
    assert matcher.failure_kind == "dead_end"


def test_the_worker_does_not_import_torch() -> None:
    """torch would put a few hundred MB and seconds into every worker start."""
    code = "import sys, engine.structured.worker; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ---- the cache's byte budget ----


def test_the_cache_stays_within_its_byte_budget(make) -> None:
    compiler = make(cache_memory=2 * 2**20)
    sizes = []
    for tag in range(8):  # distinct grammars of some hundreds of KB each
        grammar = compiler.compile(schema(object_branches(100, tag=str(tag))))
        sizes.append(grammar.size_bytes)
        assert compiler.stats().cache_bytes <= 2 * 2**20
    assert sum(sizes) > 2 * 2**20  # so the budget evicted
    assert compiler.stats().cached_grammars < 8


def test_a_grammar_larger_than_the_budget_is_refused(make) -> None:
    compiler = make(cache_memory=2**20)
    error = compile_error(compiler, StructuredOutput("regex", "(ab{100}){100}"))  # ~5 MB
    assert error.code == "grammar_too_complex" and "--structured-cache-memory" in error.message


def test_grammars_in_use_count_against_the_budget(make) -> None:
    compiler = make(cache_memory=2**20)
    held = []
    for tag in range(20):
        ticket = compiler.request(schema(object_branches(100, tag=f"h{tag}")))
        held.append(ticket)
        try:
            ticket.future.result(60)
        except ServiceUnavailableError as error:
            assert error.code == "overloaded" and error.status == 503
            break
    else:
        pytest.fail("held grammars outgrew the budget")
    assert compiler.stats().cache_bytes <= 2**20
    for ticket in held:
        ticket.release()
    assert compiler.compile(schema(object_branches(100, tag="after"))).matcher() is not None


def test_clear_drops_grammars_nobody_holds_and_stops_workers(make) -> None:
    compiler = make()
    compiler.compile(StructuredOutput("regex", "[xy]+"))
    assert compiler.stats().workers_rss_bytes > 0
    compiler.clear()
    assert compiler.stats().cache_bytes == 0
    for _ in range(100):
        if compiler.stats().workers_rss_bytes == 0:
            break
        time.sleep(0.05)
    assert compiler.stats().workers_rss_bytes == 0
    assert compiler.stats().headroom_bytes >= compiler.settings.cache_memory


def test_the_vocabulary_is_built_by_the_first_compile_and_counted_as_headroom_until_then(
    make, monkeypatch
) -> None:
    """An engine nobody asks for structured outputs never builds llguidance's vocabulary (3.4 s
    and ~280 MB for a 262,144-token one); until the first compile builds it, the headroom the
    gateway plans with counts it (here at 8 MiB a token, so that it outweighs the workers' and
    the cache's share of the headroom, which the compile changes too)."""
    from engine.structured import compiler as compiler_module

    monkeypatch.setattr(compiler_module, "VOCABULARY_BYTES_PER_TOKEN", 8 * 2**20)
    compiler = make()
    vocabulary = compiler._vocab_size * 8 * 2**20
    before = compiler.stats().headroom_bytes
    assert before >= vocabulary
    assert compiler._built_vocabulary is None
    compiler.compile(StructuredOutput("regex", "[xy]+"))
    assert compiler._built_vocabulary is not None
    assert compiler.stats().headroom_bytes < before - vocabulary + 2**30
