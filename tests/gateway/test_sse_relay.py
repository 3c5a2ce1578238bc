"""The SSE relay: event framing whatever the upstream's chunking, usage read (and stripped when
the client did not ask for it), the upstream's model name mapped back to the served one."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.limits import NO_LIMITS
from gateway.proxy import Exchange
from gateway.proxy.sse import SseRelay
from tests.gateway.conftest import model_route, seat


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


def _relay(strip: bool, rename=None):
    route = model_route()
    ex = Exchange(
        request_id="r",
        path="/v1/chat/completions",
        body=b"",
        stream=True,
        strip_usage=strip,
        route=route,
        grant=NO_LIMITS,
        seat=seat(route),
    )
    return ex, SseRelay(ex, strip, rename)


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
