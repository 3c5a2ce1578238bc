"""A grammar that allows no token mid-output ends its request with a 400 in OpenAI's shape (an
SSE error event when streaming), counted in a metric: never a 200 whose output breaks the
constraint (issue 29: `{"` and `"ab"` came back with finish_reason "abort"). The dead end is
made real by filling every mask with zeros, which is what llguidance hands back then."""

from __future__ import annotations

import json

import llguidance
import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.structured.grammars import failure_kind
from engine.structured.matcher import BitmaskFiller
from tests.engine.json_requests import COMPLETIONS, openai_error, post
from tests.engine.server_http import scrape, stream
from tests.server_utils import InProcessServer

pytestmark = pytest.mark.timeout(120)

FAILURES = (
    'modelyard_engine_structured_output_failures_total{code="grammar_dead_end",model_name="tiny"}'
)


@pytest.fixture
def dead_ends(monkeypatch) -> None:
    """Every constrained row's mask allows nothing."""
    monkeypatch.setattr(BitmaskFiller, "fill", lambda self, matchers, bitmask: bitmask.zero_())


@pytest.fixture
async def server(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_threads=1, max_model_len=256)
    srv = await InProcessServer(lambda: EngineCore(config), ["tiny"]).start()
    yield srv
    await srv.stop()


def body(**extra: object) -> dict:
    return {
        "model": "tiny",
        "prompt": "hello there",
        "max_tokens": 8,
        "temperature": 0.0,
        "structured_outputs": {"choice": ["zzzz", "zzzy"]},
        **extra,
    }


async def test_a_dead_end_is_a_400_not_a_200(server, dead_ends) -> None:
    status, payload, _ = await post(server.url + COMPLETIONS, body())
    assert status == 400, payload
    error = openai_error(payload, code="grammar_dead_end")
    assert error["type"] == "invalid_request_error"
    assert "allows no token after 0 tokens" in error["message"]
    samples = await scrape(server.url)
    assert samples[FAILURES] == 1
    # the engine carries on: a plain request is served
    plain = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
    assert (await post(server.url + COMPLETIONS, plain))[0] == 200


async def test_a_dead_end_in_a_stream_is_an_error_event(server, dead_ends) -> None:
    events = await stream(server.url + COMPLETIONS, body(stream=True, temperature=0.8, seed=1))
    assert events[-1] == "[DONE]"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1
    openai_error(errors[0], code="grammar_dead_end")
    texts = [c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", [])]
    assert "".join(texts) == ""  # the refused token was never sent


async def test_without_dead_ends_the_constraint_holds(server) -> None:
    status, payload, _ = await post(server.url + COMPLETIONS, body())
    assert status == 200 and payload["choices"][0]["text"] in ("zzzz", "zzzy")


def test_a_give_up_is_told_from_a_refused_token(tokenizer) -> None:
    """How a give-up is told from a grammar ruling the token out (the 400's code)."""
    ll_tokenizer = llguidance.LLTokenizer(
        tokenizer.backend_tokenizer.to_str(), n_vocab=len(tokenizer)
    )
    choices = json.dumps([f"w{i}" for i in range(50)])
    grammar = llguidance.grammar_from("choice", choices)
    limits = llguidance.LLParserLimits(max_items_in_row=10)
    tight = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=limits)
    refused = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    token = tokenizer.encode("w", add_special_tokens=False)[0]
    assert not tight.consume_token(token) and failure_kind(tight) == "too_complex"
    other = tokenizer.encode("q", add_special_tokens=False)[0]
    assert not refused.consume_token(other) and failure_kind(refused) == "refused"
