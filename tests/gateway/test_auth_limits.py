"""Auth matrix, admin endpoints, rate limits (accuracy and headers), the model-wide concurrency
cap."""

from __future__ import annotations

import asyncio
import time

from gateway.limits import RateLimited, RateLimiter, TokenBucket
from tests.gateway.conftest import fleet

KEYS = {
    "TEAM_A_KEY": "sk-team-a-secret",
    "TEAM_B_KEY": "sk-team-b-secret",
    "ADMIN_KEY": "sk-admin-secret",
}


def keyed_fleet(upstreams, **key_limits):
    doc = fleet([upstreams[0].url])
    doc["models"].append({"name": "secret-model", "upstreams": [upstreams[1].url]})
    doc["gateway"]["auth"] = {
        "admin_key_env": "ADMIN_KEY",
        "keys": [
            {"name": "team-a", "key_env": "TEAM_A_KEY", "models": ["m1"], **key_limits},
            {"name": "team-b", "key_env": "TEAM_B_KEY"},
        ],
    }
    return doc


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_auth_matrix(start_gateway, fresh_upstreams):
    gw = await start_gateway(keyed_fleet(fresh_upstreams), env=KEYS)
    chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    url = gw.url + "/v1/chat/completions"

    async def call(headers, body=chat):
        resp = await gw.http.post(url, json=body, headers=headers)
        return resp.status, (await resp.json())

    status, body = await call({})
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    status, body = await call(bearer("sk-wrong"))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert "sk-wrong" not in body["error"]["message"]
    status, body = await call({"Authorization": "Basic abc"})
    assert status == 401
    assert (await call(bearer(KEYS["TEAM_A_KEY"])))[0] == 200
    assert (await call(bearer(KEYS["TEAM_A_KEY"]), {**chat, "model": "default"}))[0] == 200
    # A key without the model gets the same 404 as for a model that does not exist.
    status, hidden = await call(bearer(KEYS["TEAM_A_KEY"]), {**chat, "model": "secret-model"})
    _, missing = await call(bearer(KEYS["TEAM_A_KEY"]), {**chat, "model": "no-such-model"})
    assert status == 404
    assert hidden["error"]["code"] == missing["error"]["code"] == "model_not_found"
    assert (await call(bearer(KEYS["TEAM_B_KEY"]), {**chat, "model": "secret-model"}))[0] == 200
    # /v1/models lists only what the key may use.
    resp = await gw.http.get(gw.url + "/v1/models", headers=bearer(KEYS["TEAM_A_KEY"]))
    assert {m["id"] for m in (await resp.json())["data"]} == {"m1", "default"}
    assert (await gw.http.get(gw.url + "/v1/models")).status == 401
    # Admin endpoints: admin key only.
    for headers, expected in (
        ({}, 401),
        (bearer(KEYS["TEAM_A_KEY"]), 401),
        (bearer(KEYS["ADMIN_KEY"]), 200),
    ):
        resp = await gw.http.get(gw.url + "/admin/backends", headers=headers)
        assert resp.status == expected
    # The admin key is not a client key.
    assert (await call(bearer(KEYS["ADMIN_KEY"])))[0] == 401
    # Liveness, readiness and metrics need no key.
    for path in ("/health", "/ready", "/metrics"):
        assert (await gw.http.get(gw.url + path)).status == 200


async def test_admin_disabled_without_admin_key(start_gateway, fresh_upstreams):
    doc = keyed_fleet(fresh_upstreams)
    del doc["gateway"]["auth"]["admin_key_env"]
    gw = await start_gateway(doc, env=KEYS)
    resp = await gw.http.get(gw.url + "/admin/backends", headers=bearer(KEYS["TEAM_B_KEY"]))
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "admin_disabled"


def test_token_bucket_math():
    bucket = TokenBucket(60, now=0.0)  # 1 token per second, capacity 60
    bucket.tokens = 0
    bucket.refill(0.5)
    assert abs(bucket.wait_s(1) - 0.5) < 1e-9
    bucket.refill(10.0)
    assert abs(bucket.tokens - 10.0) < 1e-9
    assert bucket.wait_s(1000) > 0  # oversized asks need a full bucket, not more
    bucket.refill(1000.0)
    assert bucket.tokens == 60 and bucket.wait_s(1000) == 0


async def test_limiter_refusal_charges_nothing():
    from gateway.config import parse_config

    doc = fleet(["http://127.0.0.1:1"])
    doc["models"][0]["limits"] = {"rpm": 600, "tpm": 100}
    limiter = RateLimiter()
    limiter.configure(parse_config(doc))
    grant = await limiter.admit(None, "m1", 90)
    requests = limiter.local.buckets["model:m1:requests"]
    tokens = limiter.local.buckets["model:m1:tokens"]
    before = (requests.tokens, tokens.tokens)
    try:
        await limiter.admit(None, "m1", 50)
        raise AssertionError("expected RateLimited")
    except RateLimited as exc:
        assert exc.limit == "model_tokens"
        assert exc.headers["x-ratelimit-limit-tokens"] == "100"
    assert abs(requests.tokens - before[0]) < 0.1
    # Usage correction: the answer used 30 tokens in all, not 90.
    grant.settle(30)
    assert abs(tokens.tokens - (before[1] + 60)) < 0.5


async def test_rpm_limit_accuracy_and_headers(start_gateway, fresh_upstreams):
    rpm = 300  # capacity 300, refills 5/s
    gw = await start_gateway(keyed_fleet(fresh_upstreams, rpm=rpm), env=KEYS)
    headers = bearer(KEYS["TEAM_A_KEY"])
    chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    accepted = refused = 0
    first_429 = None
    start = time.monotonic()
    duration = 3.0
    while time.monotonic() - start < duration and accepted + refused < 3000:
        resps = await asyncio.gather(
            *(
                gw.http.post(gw.url + "/v1/chat/completions", json=chat, headers=headers)
                for _ in range(10)
            )
        )
        for resp in resps:
            await resp.read()
            if resp.status == 200:
                accepted += 1
                assert resp.headers["x-ratelimit-limit-requests"] == str(rpm)
                assert int(resp.headers["x-ratelimit-remaining-requests"]) <= rpm
            else:
                assert resp.status == 429
                refused += 1
                first_429 = first_429 or resp
        await asyncio.sleep(0.01)
    elapsed = time.monotonic() - start
    expected = rpm + rpm / 60 * elapsed
    assert abs(accepted - expected) <= 0.05 * expected, (accepted, expected)
    assert refused > 0
    body = await first_429.json()
    assert body["error"]["type"] == "rate_limit_error"
    assert int(first_429.headers["Retry-After"]) >= 1
    assert first_429.headers["x-ratelimit-remaining-requests"] == "0"
    assert first_429.headers["x-ratelimit-reset-requests"].endswith("s")
    # The other key is not limited by team-a's bucket.
    resp = await gw.http.post(
        gw.url + "/v1/chat/completions", json=chat, headers=bearer(KEYS["TEAM_B_KEY"])
    )
    assert resp.status == 200
    assert gw.gateway.metrics.rate_limited.labels("m1", "key_requests")._value.get() == refused


async def test_tpm_limit_uses_upstream_usage(start_gateway, fresh_upstreams):
    tpm = 600  # capacity 600 tokens, refills 10/s
    doc = fleet([fresh_upstreams[0].url])
    doc["models"][0]["limits"] = {"tpm": tpm}
    gw = await start_gateway(doc)
    # Each request: the mock counts 1 prompt word + 29 completion tokens = 30 tokens.
    accepted = 0
    start = time.monotonic()
    last = None
    while time.monotonic() - start < 2.0 and accepted < 500:
        resp = await gw.chat(mock={"tokens": 29})
        await resp.read()
        last = resp
        if resp.status == 200:
            accepted += 1
        else:
            assert resp.status == 429
            assert resp.headers["x-ratelimit-limit-tokens"] == str(tpm)
            await asyncio.sleep(0.1)
    elapsed = time.monotonic() - start
    expected_tokens = tpm + tpm / 60 * elapsed
    # The pre-charge is only the prompt estimate, so the final request may overdraw once.
    assert abs(accepted * 30 - expected_tokens) <= 0.05 * expected_tokens + 30, accepted
    assert last.status == 429
    assert gw.gateway.metrics.prompt_tokens.labels("m1")._value.get() == accepted


async def test_max_concurrency_caps_the_models_slots_and_the_rest_wait(
    start_gateway, fresh_upstreams
):
    """``limits.max_concurrency`` is the model's admission cap over all its backends (each would
    take 256 here): the requests beyond it wait in the model's line instead of a 429."""
    doc = fleet([mock.url for mock in fresh_upstreams])
    doc["models"][0]["limits"] = {"max_concurrency": 3}
    gw = await start_gateway(doc)
    started = time.monotonic()
    resps = await asyncio.gather(*(gw.chat(mock={"delay_ms": 300}) for _ in range(6)))
    took = time.monotonic() - started
    assert [r.status for r in resps] == [200] * 6
    assert 0.6 <= took < 1.5  # two rounds of three, not one of six
    registry = gw.gateway.metrics.registry
    labels = {"model": "m1", "key": "_anonymous"}
    assert registry.get_sample_value("modelyard_admission_wait_seconds_count", labels) == 6
    waited = registry.get_sample_value("modelyard_admission_wait_seconds_sum", labels)
    assert 3 * 0.25 < waited < 3 * 0.6  # three waited for one round
