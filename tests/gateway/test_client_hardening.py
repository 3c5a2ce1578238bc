"""No client can take a server down: each attack against both servers (the gateway with a mock
upstream, the engine on a fake core), the answer it gets, and a valid request right after.

Covers compressed bodies under the decoded-size limit, strict JSON (lone surrogates, deep
nesting), Expect handling, deadlines for slow heads, slow bodies and idle connections, and the
connection caps (common/http_server.py, common/connections.py, common/request_body.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from common.http_server import ClientLimits
from tests.fake_core import FakeCore
from tests.gateway.conftest import MockUpstream, fleet
from tests.gateway.test_auth_limits import KEYS, keyed_fleet
from tests.server_utils import InProcessServer
from tests.tiny_models import build_tokenizer

pytestmark = pytest.mark.timeout(120)

FAST = ClientLimits(
    header_timeout_s=0.6,
    body_timeout_s=0.6,
    idle_timeout_s=0.6,
    max_connections=64,
    max_connections_per_address=64,
)
BODY_LIMIT = 64 * 1024


@dataclass
class Target:
    """One server under attack and a request it must keep answering with 200."""

    kind: str
    url: str
    http: aiohttp.ClientSession
    path: str
    valid: dict[str, Any]
    upstream: MockUpstream | None = None

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    async def post(self, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
        async with self.http.post(
            self.url + self.path,
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as reply:
            return reply.status, json.loads(await reply.read())

    async def assert_still_serving(self) -> None:
        status, payload = await self.post(json.dumps(self.valid).encode())
        assert status == 200, payload


MakeTarget = Callable[..., Awaitable[Target]]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
async def make_target(start_gateway, fresh_upstreams, tokenizer) -> AsyncIterator[MakeTarget]:
    engines: list[InProcessServer] = []
    sessions: list[aiohttp.ClientSession] = []

    async def make(
        kind: str, limits: ClientLimits = FAST, max_body_bytes: int = BODY_LIMIT
    ) -> Target:
        if kind == "gateway":
            up = fresh_upstreams[0]
            document = fleet(
                [up.url], max_body_bytes=max_body_bytes, clients=dataclasses.asdict(limits)
            )
            gw = await start_gateway(document)
            valid = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
            return Target(kind, gw.url, gw.http, "/v1/chat/completions", valid, up)
        server = await InProcessServer(
            lambda: FakeCore(tokenizer, max_model_len=64),
            ["tiny"],
            max_body_bytes=max_body_bytes,
            client_limits=limits,
        ).start()
        engines.append(server)
        session = aiohttp.ClientSession()
        sessions.append(session)
        valid = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        return Target(kind, server.url, session, "/v1/completions", valid)

    yield make
    for session in sessions:
        await session.close()
    for server in engines:
        await server.stop()


both = pytest.mark.parametrize("kind", ["gateway", "engine"])


def _deflate_stream(piece: bytes, count: int, wbits: int = zlib.MAX_WBITS) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return b"".join(packer.compress(piece) for _ in range(count)) + packer.flush()


def _error(payload: dict, code: str) -> dict:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    return error


# ---- compressed bodies ----------------------------------------------------------------------


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
    _error(payload, "body_too_large")
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
    _error(payload, "body_too_large")
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
    _error(payload, "body_too_large")
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
    _error(payload, code)
    await target.assert_still_serving()


# ---- strict JSON ----------------------------------------------------------------------------


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
    assert "surrogate" in _error(payload, "invalid_json")["message"]
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
        _error(await resp.json(), "invalid_json")
    assert (await gw.chat("default")).status == 200


@both
@pytest.mark.parametrize("depth", [1000, 100_000])
async def test_deep_nesting_is_400(make_target, kind, depth):
    target = await make_target(kind, max_body_bytes=1 << 20)
    nested = "[" * depth + "]" * depth
    body = json.dumps(target.valid)[:-1].encode() + b', "x": ' + nested.encode() + b"}"
    status, payload = await target.post(body)
    assert status == 400
    assert "deeper than" in _error(payload, "invalid_json")["message"]
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
    _error(json.loads(payload), "invalid_api_key")


@both
async def test_long_model_name_is_not_echoed_in_full(make_target, kind):
    target = await make_target(kind, max_body_bytes=4 << 20)
    status, payload = await target.post(json.dumps({**target.valid, "model": "m" * 2**20}).encode())
    assert status == 404
    assert len(_error(payload, "model_not_found")["message"]) < 400
    await target.assert_still_serving()


# ---- Expect ---------------------------------------------------------------------------------


async def _open(target: Target, local_host: str | None = None):
    host, port = target.host_port
    local = (local_host, 0) if local_host else None
    return await asyncio.open_connection(host, port, local_addr=local)


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status_line, *lines = head.decode("latin-1").strip().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", 0))
    body = await asyncio.wait_for(reader.readexactly(length), 5) if length else b""
    return int(status_line.split()[1]), headers, body


def _head(target: Target, length: int, extra: str = "") -> bytes:
    return (
        f"POST {target.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


@both
async def test_unknown_expect_is_json_417(make_target, kind):
    target = await make_target(kind)
    reader, writer = await _open(target)
    body = json.dumps(target.valid).encode()
    writer.write(_head(target, len(body), "Expect: something-else\r\n") + body)
    status, headers, payload = await _read_answer(reader)
    writer.close()
    assert status == 417 and headers["content-type"].startswith("application/json")
    _error(json.loads(payload), "expectation_failed")
    await target.assert_still_serving()


@both
async def test_expect_100_continue(make_target, kind):
    target = await make_target(kind)
    # Over the limit: refused before the client sends the body, never "100 Continue".
    reader, writer = await _open(target)
    writer.write(_head(target, BODY_LIMIT + 1, "Expect: 100-continue\r\n"))
    status, _, payload = await _read_answer(reader)
    writer.close()
    assert status == 413
    _error(json.loads(payload), "body_too_large")
    # Within it: 100 Continue, then the answer.
    reader, writer = await _open(target)
    body = json.dumps(target.valid).encode()
    writer.write(_head(target, len(body), "Expect: 100-continue\r\n"))
    status, _, _ = await _read_answer(reader)
    assert status == 100
    writer.write(body)
    status, _, payload = await _read_answer(reader)
    writer.close()
    assert status == 200, payload


# ---- slow and idle clients ------------------------------------------------------------------


async def _closed_after(reader: asyncio.StreamReader, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closed the connection, and what it sent before."""
    started = time.monotonic()
    data = await asyncio.wait_for(reader.read(), limit_s)
    return time.monotonic() - started, data


@both
async def test_slow_header_is_cut_off_at_the_head_deadline(make_target, kind):
    target = await make_target(kind)
    reader, writer = await _open(target)
    started = time.monotonic()

    async def trickle() -> None:  # one byte every 0.2 s, as a slowloris client does
        for byte in _head(target, 2):
            writer.write(bytes([byte]))
            await asyncio.sleep(0.2)

    trickling = asyncio.create_task(trickle())
    try:
        data = await asyncio.wait_for(reader.read(), 5)
    finally:
        trickling.cancel()
        writer.close()
    elapsed = time.monotonic() - started
    assert FAST.header_timeout_s - 0.1 <= elapsed < FAST.header_timeout_s + 1.5
    assert data.startswith(b"HTTP/1.1 408")
    _error(json.loads(data.partition(b"\r\n\r\n")[2]), "request_timeout")
    await target.assert_still_serving()


@both
async def test_slow_body_is_cut_off_at_the_body_deadline(make_target, kind):
    target = await make_target(kind)
    body = json.dumps(target.valid).encode()
    reader, writer = await _open(target)
    writer.write(_head(target, len(body)))
    started = time.monotonic()

    async def trickle() -> None:
        for byte in body:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.2)

    trickling = asyncio.create_task(trickle())
    try:
        status, headers, payload = await _read_answer(reader)
        answered = time.monotonic() - started
        # The client keeps trickling: the rest of its body is dropped only briefly, then the
        # connection closes (not after aiohttp's default 10 s of lingering).
        lingered, _ = await _closed_after(reader, 10)
    finally:
        trickling.cancel()
        writer.close()
    assert status == 408 and headers["connection"].lower() == "close"
    _error(json.loads(payload), "request_timeout")
    assert answered < FAST.body_timeout_s + 1.5
    assert lingered < 3.5
    await target.assert_still_serving()


@both
async def test_idle_connections_are_closed(make_target, kind):
    target = await make_target(kind)
    # A connection that never sends anything.
    reader, writer = await _open(target)
    elapsed, data = await _closed_after(reader, 5)
    writer.close()
    assert data == b"" and elapsed < FAST.idle_timeout_s + 1.5
    # A keep-alive connection after one exchange.
    reader, writer = await _open(target)
    body = json.dumps(target.valid).encode()
    writer.write(_head(target, len(body)) + body)
    status, _, _ = await _read_answer(reader)
    assert status == 200
    elapsed, data = await _closed_after(reader, 5)
    writer.close()
    assert data == b"" and FAST.idle_timeout_s - 0.1 <= elapsed < FAST.idle_timeout_s + 1.5


async def _is_closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 0.2) == b""
    except TimeoutError:
        return False


@both
async def test_idle_connections_beyond_the_cap_do_not_stop_valid_requests(make_target, kind):
    slow = dataclasses.replace(FAST, idle_timeout_s=30, max_connections=16)
    target = await make_target(kind, limits=slow)
    idle = [await _open(target) for _ in range(40)]  # silent: never a byte
    await asyncio.sleep(0.1)
    for _ in range(5):
        await target.assert_still_serving()
    closed = [await _is_closed(reader) for reader, _ in idle]
    for _, writer in idle:
        writer.close()
    assert sum(closed) >= 40 - 16  # the cap made room by closing the oldest idle ones
    assert not any(closed[-8:])  # ...and the newest are still open


@both
async def test_busy_connections_at_the_address_cap_refuse_only_that_address(make_target, kind):
    limits = dataclasses.replace(
        FAST, header_timeout_s=5, idle_timeout_s=30, max_connections_per_address=4
    )
    target = await make_target(kind, limits=limits)
    # The gateway test client keeps its own keep-alive connections: use another address for
    # the attacker, so that this test's session is not the one refused.
    busy = []
    for _ in range(4):  # each mid-head: busy, not evictable, until its head deadline
        reader, writer = await _open(target, "127.0.0.2")
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\n")
        busy.append((reader, writer))
    await asyncio.sleep(0.1)
    reader, writer = await _open(target, "127.0.0.2")
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, payload = await _read_answer(reader)
    writer.close()
    assert status == 429 and headers["retry-after"] == "1"
    _error(json.loads(payload), "too_many_connections")
    await target.assert_still_serving()  # from 127.0.0.1
    for _, busy_writer in busy:
        busy_writer.close()


@both
@pytest.mark.parametrize("version", [b"HTTP/0.9", b"HTTP/2.0"])
async def test_other_http_versions_get_a_readable_400(make_target, kind, version):
    target = await make_target(kind)
    reader, writer = await _open(target)
    writer.write(b"GET /health " + version + b"\r\nHost: x\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert data.startswith(b"HTTP/1.1 400 ")  # not in the version asked for
    _error(json.loads(data.partition(b"\r\n\r\n")[2]), "http_version_not_supported")
    await target.assert_still_serving()
