"""Connections no client can hold a server with: Expect handling, deadlines for slow heads,
slow bodies and idle connections, the connection caps, and HTTP versions other than 1.x; a
valid request right after each."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from tests.gateway.client_hardening.targets import BODY_LIMIT, FAST, Target, both, openai_error

pytestmark = pytest.mark.timeout(120)


async def _open(
    target: Target, local_host: str | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
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
    openai_error(json.loads(payload), "expectation_failed")
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
    openai_error(json.loads(payload), "body_too_large")
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
    openai_error(json.loads(data.partition(b"\r\n\r\n")[2]), "request_timeout")
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
    openai_error(json.loads(payload), "request_timeout")
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
    openai_error(json.loads(payload), "too_many_connections")
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
    openai_error(json.loads(data.partition(b"\r\n\r\n")[2]), "http_version_not_supported")
    await target.assert_still_serving()
