"""What the OpenAI endpoints take from a request before proxying it: affinity keys, prompt token
estimates, and the body sent upstream (rewritten only when a field must change)."""

from __future__ import annotations

import json

from gateway.openai_api import affinity_key, estimate_prompt_tokens, upstream_body
from tests.gateway.conftest import model_route


def test_affinity_keys():
    chat = {
        "model": "m",
        "user": "alice",
        "messages": [{"role": "system", "content": "abc"}, {"role": "user", "content": "defgh"}],
    }
    assert affinity_key(model_route(), chat) is None
    assert affinity_key(model_route(affinity={"by": "user"}), chat) == b"alice"
    prefix = model_route(affinity={"by": "prefix", "prefix_chars": 5})
    assert affinity_key(prefix, chat) == b"abcde"
    assert affinity_key(model_route(affinity={"by": "prefix"}), {"prompt": "xyz"}) == b"xyz"


def test_prompt_token_estimates():
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_prompt_tokens({"prompt": "a" * 400}) == 101
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "b" * 40}]}]}
    assert estimate_prompt_tokens(chat) == 4 + 10 + 1


def test_upstream_body_rewrites_only_when_needed():
    route = model_route(upstream_model="org/Big")
    raw = b'{"model": "m", "messages": []}'
    body, strip = upstream_body(raw, json.loads(raw), route, stream=False)
    assert json.loads(body)["model"] == "org/Big" and not strip
    plain = model_route()
    same, strip = upstream_body(raw, json.loads(raw), plain, stream=False)
    assert same is raw and not strip  # the original bytes, untouched
    streamed, strip = upstream_body(raw, json.loads(raw), plain, stream=True)
    assert json.loads(streamed)["stream_options"] == {"include_usage": True} and strip
    asked = b'{"model": "m", "stream_options": {"include_usage": true}}'
    body, strip = upstream_body(asked, json.loads(asked), plain, stream=True)
    assert body is asked and not strip
