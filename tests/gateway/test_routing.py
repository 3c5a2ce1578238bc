"""Routing by served name and alias, model rewriting, balancing, affinity, error statuses."""

from __future__ import annotations

import asyncio
import json
import time

from tests.gateway.conftest import fleet


async def test_routes_by_name_and_alias_and_rewrites_model(start_gateway, fresh_upstreams):
    doc = fleet([fresh_upstreams[0].url])
    doc["models"][0]["upstream_model"] = "org/Upstream-Name"
    gw = await start_gateway(doc)
    for name in ("m1", "default"):
        resp = await gw.chat(name, max_tokens=3)
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert body["model"] == "m1"  # the served name, not the upstream's own
        assert body["choices"][0]["message"]["content"] == "tok tok tok "
        assert body["usage"]["completion_tokens"] == 3
        assert resp.headers["x-request-id"]
        stats = fresh_upstreams[0].stats()
        assert stats["last_body"]["model"] == "org/Upstream-Name"
        assert stats["last_headers"]["x-request-id"] == resp.headers["x-request-id"]
        assert "authorization" not in stats["last_headers"]


async def test_forwards_body_bytes_unchanged_when_nothing_to_rewrite(
    start_gateway, fresh_upstreams
):
    gw = await start_gateway(fleet([fresh_upstreams[0].url]))
    raw = (
        b'{"model":"m1","messages":[{"role":"user","content":"a b c"}],"mock":{"tokens":2},'
        b'"extra_field":{"kept":true}}'
    )
    resp = await gw.http.post(
        gw.url + "/v1/chat/completions",
        data=raw,
        headers={"Content-Type": "application/json", "x-request-id": "client-id-1"},
    )
    assert resp.status == 200
    assert resp.headers["x-request-id"] == "client-id-1"
    stats = fresh_upstreams[0].stats()
    assert stats["last_body"]["extra_field"] == {"kept": True}
    assert stats["last_headers"]["x-request-id"] == "client-id-1"
    assert (await resp.json())["usage"]["prompt_tokens"] == 3


async def test_completions_endpoint_and_models_list(start_gateway, fresh_upstreams):
    doc = fleet([fresh_upstreams[0].url])
    doc["models"].append({"name": "m2", "upstreams": [fresh_upstreams[1].url]})
    gw = await start_gateway(doc)
    resp = await gw.post("/v1/completions", {"model": "m2", "prompt": "x y", "max_tokens": 2})
    assert resp.status == 200
    body = await resp.json()
    assert body["choices"][0]["text"] == "tok tok "
    assert fresh_upstreams[1].stats()["last_body"]["model"] == "m2"
    models = await (await gw.http.get(gw.url + "/v1/models")).json()
    ids = {m["id"]: m["root"] for m in models["data"]}
    assert ids == {"m1": "m1", "default": "m1", "m2": "m2"}


async def test_least_outstanding_balancing_spreads_load(start_gateway, fresh_upstreams):
    gw = await start_gateway(fleet([u.url for u in fresh_upstreams]))
    before = [u.stats()["requests"] for u in fresh_upstreams]
    resps = await asyncio.gather(*(gw.chat(mock={"delay_ms": 30}) for _ in range(40)))
    assert all(r.status == 200 for r in resps)
    counts = [u.stats()["requests"] - b for u, b in zip(fresh_upstreams, before, strict=True)]
    assert sum(counts) == 40
    assert min(counts) >= 12, counts  # p2c on two replicas keeps them close to even


async def test_prefix_affinity_sticks_and_falls_back(start_gateway, fresh_upstreams):
    doc = fleet([u.url for u in fresh_upstreams])
    doc["models"][0]["affinity"] = {"by": "prefix", "prefix_chars": 32, "max_extra_load": 2}
    gw = await start_gateway(doc)
    route = gw.gateway.router.resolve("m1")
    counts = {}
    for prompt in ("system prompt A " * 4, "another prefix B " * 4):
        before = [u.stats()["requests"] for u in fresh_upstreams]
        for i in range(6):
            msgs = [{"role": "user", "content": prompt + f" question {i}"}]
            resp = await gw.post("/v1/chat/completions", {"model": "m1", "messages": msgs})
            assert resp.status == 200
        after = [u.stats()["requests"] for u in fresh_upstreams]
        counts[prompt] = [a - b for a, b in zip(after, before, strict=True)]
        assert sorted(counts[prompt]) == [0, 6], counts  # all on one replica
    # When the warm replica is busy beyond max_extra_load, the request goes elsewhere.
    key = ("system prompt A " * 4)[:32].encode()
    warm = route.pick((), key)
    other = next(b for b in route.backends if b is not warm)
    warm.outstanding += 5
    try:
        assert route.pick((), key) is other
    finally:
        warm.outstanding -= 5


async def test_error_statuses_are_openai_shaped(start_gateway, fresh_upstreams):
    gw = await start_gateway(fleet([fresh_upstreams[0].url], max_body_bytes=2048))
    cases = [
        (
            await gw.http.post(gw.url + "/v1/chat/completions", data=b"{not json"),
            400,
            "invalid_json",
        ),
        (await gw.post("/v1/chat/completions", [1, 2]), 400, "invalid_json"),
        (await gw.post("/v1/chat/completions", {"messages": []}), 400, "invalid_value"),
        (
            await gw.post("/v1/chat/completions", {"model": "m1", "messages": "hi"}),
            400,
            "invalid_value",
        ),
        (await gw.post("/v1/completions", {"model": "m1"}), 400, "invalid_value"),
        (await gw.chat(stream="yes"), 400, "invalid_value"),
        (await gw.chat("nope"), 404, "model_not_found"),
        (await gw.chat(padding="x" * 4096), 413, "body_too_large"),
        (await gw.http.get(gw.url + "/v1/nothing-here"), 404, "http_error"),
        (await gw.http.get(gw.url + "/v1/chat/completions"), 405, "http_error"),
    ]
    for resp, status, code in cases:
        assert resp.status == status, (status, await resp.text())
        body = await resp.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == code
        assert resp.headers["x-request-id"]
    # Upstream errors: 4xx passes through, 500 passes through (not retried), 503 after retries.
    fresh_upstreams[0].control(fail=500)
    resp = await gw.chat()
    assert resp.status == 500
    assert (await resp.json())["error"]["message"] == "mock failure 500"


async def test_chunked_body_over_limit_is_413(start_gateway, fresh_upstreams):
    gw = await start_gateway(fleet([fresh_upstreams[0].url], max_body_bytes=1024))

    async def chunks():
        for _ in range(10):
            yield b" " * 512

    resp = await gw.http.post(gw.url + "/v1/chat/completions", data=chunks())
    assert resp.status == 413
    assert json.loads(await resp.read())["error"]["code"] == "body_too_large"


async def test_no_healthy_backend_is_fast_503(start_gateway, fresh_upstreams):
    fresh_upstreams[0].control(ready=False)
    gw = await start_gateway(fleet([fresh_upstreams[0].url]))
    route = gw.gateway.router.resolve("m1")
    for _ in range(100):
        if not route.backends[0].available:
            break
        await asyncio.sleep(0.02)
    timings = []
    for _ in range(5):  # the fastest of a few, so one scheduling stall on a busy box is no fail
        start = time.perf_counter()
        resp = await gw.chat()
        timings.append(time.perf_counter() - start)
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_healthy_backend"
        # SDKs pace their retries by it: the next health check may re-admit the backend
        assert int(resp.headers["Retry-After"]) >= 1
    assert min(timings) < 0.02
    ready = await gw.http.get(gw.url + "/ready")
    assert ready.status == 503
    fresh_upstreams[0].control()
    for _ in range(100):
        if route.backends[0].available:
            break
        await asyncio.sleep(0.02)
    assert (await gw.chat()).status == 200
    assert (await gw.http.get(gw.url + "/ready")).status == 200


async def test_oversized_header_is_refused(start_gateway, fresh_upstreams):
    gw = await start_gateway(fleet([fresh_upstreams[0].url], max_header_bytes=2048))
    before = fresh_upstreams[0].stats()["requests"]
    resp = await gw.http.post(
        gw.url + "/v1/chat/completions", json={"model": "m1"}, headers={"x-big": "y" * 4096}
    )
    assert resp.status in (400, 431)
    assert fresh_upstreams[0].stats()["requests"] == before
