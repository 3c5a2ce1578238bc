"""Bodies no client can hurt a server with: compressed ones under the decoded-size limit
(bombs, bad encodings) and strict JSON (lone surrogates, deep nesting), a non-UTF-8
Authorization header and a huge model name; a valid request right after each."""

from __future__ import annotations

import asyncio
import gzip
import json
import tracemalloc
import zlib
from typing import Any

import pytest

from tests.gateway.client_hardening.targets import BODY_LIMIT, Target, both, openai_error
from tests.gateway.conftest import fleet
from tests.gateway.test_auth_limits import KEYS, keyed_fleet

pytestmark = pytest.mark.timeout(120)


def _deflate_stream(piece: bytes, count: int, wbits: int = zlib.MAX_WBITS) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return b"".join(packer.compress(piece) for _ in range(count)) + packer.flush()


# Payloads are built before the servers start: building one blocks the test's event loop, which
# the in-process gateway's health checks share.


@both
async def test_deflate_bomb_is_413_without_inflating_it(make_target, kind):
    bomb = _deflate_stream(bytes(1 << 20), 256)  # 256 MiB of zeros in ~250 KB
    assert len(bomb) < 1 << 20  # passes the limit on the wire: only the decoded size can refuse it
    target = await make_target(kind, max_body_bytes=1 << 20)
    tracemalloc.start()  # the server runs in this process: its allocations are traced too
    try:
        status, payload = await target.post(bomb, {"Content-Encoding": "deflate"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 413
    openai_error(payload, "body_too_large")
    assert peak < 8 * 2**20  # inflating even one network read of it would cost far more
    await target.assert_still_serving()


@both
async def test_gzip_of_spaces_is_413_not_invalid_json(make_target, kind):
    # Small enough on the wire to pass the raw limit; the decoded size is what counts.
    packed = _deflate_stream(b" " * (1 << 20), 16, wbits=16 + zlib.MAX_WBITS)
    assert len(packed) < BODY_LIMIT
    target = await make_target(kind)
    status, payload = await target.post(packed, {"Content-Encoding": "gzip"})
    assert status == 413
    openai_error(payload, "body_too_large")
    await target.assert_still_serving()


@both
@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_compressed_valid_request_is_served(make_target, kind, coding):
    target = await make_target(kind)
    raw = json.dumps(target.valid).encode()
    packed = gzip.compress(raw) if coding == "gzip" else zlib.compress(raw)
    status, payload = await target.post(packed, {"Content-Encoding": coding})
    assert status == 200, payload
    if target.upstream is not None:  # forwarded decoded, as plain JSON
        assert target.upstream.stats()["last_body"]["messages"] == target.valid["messages"]


async def test_padded_compressed_request_is_not_forwarded(make_target):
    chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    packed = gzip.compress(json.dumps({**chat, "padding": " " * (64 << 20)}).encode())
    target = await make_target("gateway")
    assert target.upstream is not None
    before = target.upstream.stats()["requests"]
    status, payload = await target.post(packed, {"Content-Encoding": "gzip"})
    assert status == 413
    openai_error(payload, "body_too_large")
    assert target.upstream.stats()["requests"] == before
    await target.assert_still_serving()


@both
@pytest.mark.parametrize(
    ("coding", "body", "status", "code"),
    [
        ("gzip", b"this is not gzip", 400, "invalid_body_encoding"),
        ("gzip", gzip.compress(b'{"model": "m1"}')[:-5], 400, "invalid_body_encoding"),
        ("deflate", b"\x00\xff\x00\xff garbage", 400, "invalid_body_encoding"),
        ("br", b"\x0b\x02\x80hi\x03", 415, "unsupported_content_encoding"),
        ("gzip, gzip", gzip.compress(gzip.compress(b"{}")), 415, "unsupported_content_encoding"),
    ],
)
async def test_bad_encodings_are_4xx(make_target, kind, coding, body, status, code):
    target = await make_target(kind)
    got, payload = await target.post(body, {"Content-Encoding": coding})
    assert got == status
    openai_error(payload, code)
    await target.assert_still_serving()


def _with_content(target: Target, text: str) -> dict[str, Any]:
    if "messages" in target.valid:
        return {**target.valid, "messages": [{"role": "user", "content": text}]}
    return {**target.valid, "prompt": text}


@both
@pytest.mark.parametrize("extra", [{}, {"stream": True}])
async def test_lone_surrogate_is_400(make_target, kind, extra):
    target = await make_target(kind)
    body = json.dumps({**_with_content(target, "\ud800 hi"), **extra}).encode()  # an escape
    assert b"\\ud800" in body
    status, payload = await target.post(body)
    assert status == 400
    assert "surrogate" in openai_error(payload, "invalid_json")["message"]
    await target.assert_still_serving()


async def test_lone_surrogate_is_400_where_the_gateway_re_encodes(make_target, start_gateway):
    # An alias and a wire name both make the gateway rewrite the body before forwarding it.
    target = await make_target("gateway")
    assert target.upstream is not None
    document = fleet([target.upstream.url])
    document["models"][0]["upstream_model"] = "mock-a"
    gw = await start_gateway(document)
    for model in ("m1", "default"):
        body = {"model": model, "messages": [{"role": "user", "content": "x\udfff"}]}
        resp = await gw.post("/v1/chat/completions", body)
        assert resp.status == 400
        openai_error(await resp.json(), "invalid_json")
    assert (await gw.chat("default")).status == 200


@both
@pytest.mark.parametrize("depth", [1000, 100_000])
async def test_deep_nesting_is_400(make_target, kind, depth):
    target = await make_target(kind, max_body_bytes=1 << 20)
    nested = "[" * depth + "]" * depth
    body = json.dumps(target.valid)[:-1].encode() + b', "x": ' + nested.encode() + b"}"
    status, payload = await target.post(body)
    assert status == 400
    assert "deeper than" in openai_error(payload, "invalid_json")["message"]
    await target.assert_still_serving()


async def test_non_utf8_authorization_is_401(start_gateway, fresh_upstreams):
    gw = await start_gateway(keyed_fleet(fresh_upstreams), env=KEYS)
    host, port = gw.url.removeprefix("http://").split(":")
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % len(body)
    ) + body
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401")
    openai_error(json.loads(payload), "invalid_api_key")


@both
async def test_long_model_name_is_not_echoed_in_full(make_target, kind):
    target = await make_target(kind, max_body_bytes=4 << 20)
    status, payload = await target.post(json.dumps({**target.valid, "model": "m" * 2**20}).encode())
    assert status == 404
    assert len(openai_error(payload, "model_not_found")["message"]) < 400
    await target.assert_still_serving()
