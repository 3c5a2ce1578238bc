"""Unit tests of pure pieces: SSE relay framing, affinity keys, prompt token estimates, budget."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import RetrySettings, parse_config
from gateway.openai_api import affinity_key, estimate_prompt_tokens, upstream_body
from gateway.proxy import Exchange, RetryBudget, SseRelay
from gateway.ratelimit import NO_LIMITS
from gateway.router import Router


def _route(**model):
    config = parse_config({"models": [{"name": "m", "upstreams": ["http://127.0.0.1:9"], **model}]})
    router = Router()
    router.apply(config)
    return router.resolve("m")


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CHUNKS = [
    _event({"choices": [{"delta": {"content": f"t{i}"}}], "model": "up/x", "usage": None})
    for i in range(5)
]
USAGE = _event(
    {
        "choices": [],
        "model": "up/x",
        "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
    }
)
STREAM = b"".join(CHUNKS) + USAGE + b"data: [DONE]\n\n"


def _relay(strip: bool, rewrite=None):
    ex = Exchange(
        request_id="r",
        path="/v1/chat/completions",
        body=b"",
        stream=True,
        strip_usage=strip,
        route=_route(),
        admission=NO_LIMITS,
    )
    return ex, SseRelay(ex, strip, rewrite)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12), st.booleans())
def test_sse_relay_any_chunking(cuts, strip):
    """However the upstream's bytes are cut, the client gets the same events, whole."""
    points = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    ex, relay = _relay(strip)
    out = []
    for piece in pieces:
        data = relay.feed(piece)
        if data:
            assert data.endswith(b"\n\n")  # never half an event
        out.append(data)
    out.append(relay.flush())
    expected = b"".join(CHUNKS) + (b"" if strip else USAGE) + b"data: [DONE]\n\n"
    assert b"".join(out) == expected
    assert relay.done
    assert (ex.prompt_tokens, ex.completion_tokens) == (7, 5)


def test_sse_relay_rewrites_model_and_handles_crlf():
    ex, relay = _relay(False, (b'"up/x"', b'"m"'))
    out = relay.feed(STREAM.replace(b"\n\n", b"\r\n\r\n")) + relay.flush()
    assert b'"up/x"' not in out and out.count(b'"model": "m"') == 6
    assert relay.done and ex.completion_tokens == 5


def test_affinity_keys():
    chat = {
        "model": "m",
        "user": "alice",
        "messages": [{"role": "system", "content": "abc"}, {"role": "user", "content": "defgh"}],
    }
    assert affinity_key(_route(), chat) is None
    assert affinity_key(_route(affinity={"by": "user"}), chat) == b"alice"
    assert affinity_key(_route(affinity={"by": "prefix", "prefix_chars": 5}), chat) == b"abcde"
    assert affinity_key(_route(affinity={"by": "prefix"}), {"prompt": "xyz"}) == b"xyz"


def test_prompt_token_estimates():
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_prompt_tokens({"prompt": "a" * 400}) == 101
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "b" * 40}]}]}
    assert estimate_prompt_tokens(chat) == 4 + 10 + 1


def test_upstream_body_rewrites_only_when_needed():
    route = _route(upstream_model="org/Big")
    raw = b'{"model": "m", "messages": []}'
    body, strip = upstream_body(raw, json.loads(raw), route, stream=False)
    assert json.loads(body)["model"] == "org/Big" and not strip
    plain = _route()
    same, strip = upstream_body(raw, json.loads(raw), plain, stream=False)
    assert same is raw and not strip  # the original bytes, untouched
    streamed, strip = upstream_body(raw, json.loads(raw), plain, stream=True)
    assert json.loads(streamed)["stream_options"] == {"include_usage": True} and strip
    asked = b'{"model": "m", "stream_options": {"include_usage": true}}'
    body, strip = upstream_body(asked, json.loads(asked), plain, stream=True)
    assert body is asked and not strip


def test_retry_budget_is_bounded():
    budget = RetryBudget(RetrySettings(budget_percent=20, budget_min=0))
    budget.balance = 0
    for _ in range(50):
        budget.deposit()
    assert sum(budget.try_spend() for _ in range(100)) in (9, 10)  # 20 % of 50 (float sums)
    for _ in range(10_000):  # a long healthy spell banks at most the cap
        budget.deposit()
    assert sum(budget.try_spend() for _ in range(1000)) <= budget.cap
