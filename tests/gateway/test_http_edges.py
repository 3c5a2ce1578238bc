"""Answers outside the happy path: requests aiohttp's parser refuses (OpenAI-shaped, not plain
text), upstream back-off hints passed through, and the Prometheus service-discovery endpoint."""

from __future__ import annotations

import json

from gateway.admin import _external_target
from tests.gateway.conftest import fleet
from tests.gateway.test_auth_limits import KEYS, bearer, keyed_fleet
from tests.raw_http import assert_openai_error, raw_exchange

RATE_HINTS = {
    "Retry-After": "7",
    "retry-after-ms": "6500",
    "X-RateLimit-Limit-Requests": "60",  # the gateway's own header, in another case
    "x-ratelimit-remaining-requests": "0",
    "x-ratelimit-reset-requests": "6.5s",
}


async def test_oversized_header_gets_json_431(start_gateway, fresh_upstreams):
    gw = await start_gateway(fleet([fresh_upstreams[0].url], max_header_bytes=1024))
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: "
        + b"a" * 2000
        + b"\r\nContent-Length: 0\r\n\r\n"
    )
    status, headers, body = await raw_exchange(gw.url, request)
    assert status == 431
    assert_openai_error(headers, body, "request_header_fields_too_large")
    assert b"aaaa" not in body  # the refused header is not echoed back

    # An over-long request line too (the same limit applies to it).
    status, headers, body = await raw_exchange(
        gw.url, b"GET /" + b"p" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    assert status == 431
    assert_openai_error(headers, body, "request_header_fields_too_large")

    # Just under the limit still works, through the normal path.
    resp = await gw.http.get(gw.url + "/health", headers={"X-Big": "a" * 900})
    assert resp.status == 200


async def test_too_many_headers_gets_json_431(start_gateway, fresh_upstreams):
    gw = await start_gateway(fleet([fresh_upstreams[0].url]))
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(300))  # aiohttp's cap is 128
    status, headers, body = await raw_exchange(
        gw.url, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"
    )
    assert status == 431
    assert_openai_error(headers, body, "request_header_fields_too_large")


async def test_malformed_request_gets_json_400(start_gateway, fresh_upstreams):
    gw = await start_gateway(fleet([fresh_upstreams[0].url]))
    status, headers, body = await raw_exchange(
        gw.url, b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Name: v\r\n\r\n"
    )
    assert status == 400
    assert_openai_error(headers, body, "invalid_http_request")


async def test_upstream_429_hints_reach_the_client(start_gateway, fresh_upstreams):
    up = fresh_upstreams[0]
    gw = await start_gateway(fleet([up.url]))
    up.control(fail=429, fail_headers=RATE_HINTS)
    for stream in (False, True):
        resp = await gw.chat(stream=stream)
        assert resp.status == 429
        assert (await resp.json())["error"]["message"] == "mock failure 429"
        for name, value in RATE_HINTS.items():
            assert resp.headers[name] == value, (stream, name)
        assert resp.headers["x-request-id"]
    up.control()
    resp = await gw.chat()
    assert resp.status == 200 and "Retry-After" not in resp.headers


async def test_upstream_hints_win_over_the_gateways_own_limit_headers(
    start_gateway, fresh_upstreams
):
    up = fresh_upstreams[0]
    gw = await start_gateway(keyed_fleet(fresh_upstreams, rpm=1000), env=KEYS)
    url = gw.url + "/v1/chat/completions"
    chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    resp = await gw.http.post(url, json=chat, headers=bearer(KEYS["TEAM_A_KEY"]))
    assert resp.status == 200 and resp.headers["x-ratelimit-limit-requests"] == "1000"
    up.control(fail=429, fail_headers=RATE_HINTS)
    resp = await gw.http.post(url, json=chat, headers=bearer(KEYS["TEAM_A_KEY"]))
    assert resp.status == 429
    assert resp.headers.getall("x-ratelimit-limit-requests") == ["60"]
    assert resp.headers["Retry-After"] == "7"
    up.control()


async def test_upstream_503_hints_pass_after_retries(start_gateway, fresh_upstreams):
    a, b = fresh_upstreams
    gw = await start_gateway(fleet([a.url, b.url], retries={"attempts": 2, "backoff_ms": 1}))
    for up in (a, b):
        up.control(fail=503, fail_headers={"Retry-After": "3", "X-Other": "no"})
    resp = await gw.chat()
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "3"
    assert "X-Other" not in resp.headers  # only back-off hints pass, not arbitrary headers


async def test_500_does_not_pass_headers(start_gateway, fresh_upstreams):
    up = fresh_upstreams[0]
    gw = await start_gateway(fleet([up.url], retries={"attempts": 1}))
    up.control(fail=500, fail_headers={"Retry-After": "3"})
    resp = await gw.chat()
    assert resp.status == 500 and "Retry-After" not in resp.headers


async def test_prometheus_targets_needs_admin_key_and_lists_external_on_request(
    start_gateway, fresh_upstreams
):
    gw = await start_gateway(keyed_fleet(fresh_upstreams), env=KEYS)
    url = gw.url + "/admin/prometheus/targets"
    assert (await gw.http.get(url)).status == 401
    assert (await gw.http.get(url, headers=bearer(KEYS["TEAM_A_KEY"]))).status == 401
    resp = await gw.http.get(url, headers=bearer(KEYS["ADMIN_KEY"]))
    assert resp.status == 200 and await resp.json() == []  # no local engines in this fleet
    resp = await gw.http.get(url + "?external=true", headers=bearer(KEYS["ADMIN_KEY"]))
    groups = await resp.json()
    expected = {
        (up_model, up.url.removeprefix("http://"))
        for up_model, up in (("m1", fresh_upstreams[0]), ("secret-model", fresh_upstreams[1]))
    }
    assert {(g["labels"]["model"], g["targets"][0]) for g in groups} == expected
    for group in groups:
        assert group["labels"]["kind"] == "external"
        assert group["labels"]["__metrics_path__"] == "/metrics"
        assert group["labels"]["__scheme__"] == "http"


def test_external_target_never_carries_credentials():
    group = _external_target("big", "https://user:s3cret@gpu-node.example/openai")
    assert group["targets"] == ["gpu-node.example:443"]
    assert group["labels"]["__metrics_path__"] == "/openai/metrics"
    assert group["labels"]["__scheme__"] == "https"
    assert "s3cret" not in json.dumps(group)
    assert _external_target("v6", "http://[::1]:8001")["targets"] == ["[::1]:8001"]
