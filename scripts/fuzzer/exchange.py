"""One exchange with a server over a raw asyncio stream: the case's bytes sent as they are, one
answer read (interim answers skipped, chunked or sized bodies, capped)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field

from scripts.fuzzer.request import Case

ANSWER_CAP = 16 * 2**20  # an answer longer than this is cut (none should come near)


@dataclass
class Answer:
    outcome: str  # answered | timeout | closed | malformed | refused
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    detail: str = ""


async def exchange(host: str, port: int, case: Case, timeout_s: float) -> Answer:
    """Sends the case's bytes as they are while reading one answer (a server may answer before
    it has read the whole body); the connection is reset afterwards, leaving no TIME_WAIT."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=2 * 2**20), timeout_s
        )
    except (OSError, TimeoutError) as exc:
        return Answer("refused", detail=repr(exc))
    sender = asyncio.create_task(_send(writer, case.wire()))
    try:
        async with asyncio.timeout(timeout_s):
            return await read_answer(reader, case.method)
    except TimeoutError:
        return Answer("timeout", detail=f"no answer within {timeout_s:g} s")
    finally:
        sender.cancel()
        _reset(writer)


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        writer.write(data)
        await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def read_answer(reader: asyncio.StreamReader, method: str) -> Answer:
    try:
        status, headers = await _read_head(reader)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return Answer("closed", detail="EOF before any answer")
        return Answer("malformed", detail=f"head cut short: {exc.partial[:120]!r}")
    except ConnectionError as exc:
        return Answer("closed", detail=repr(exc))
    except (ValueError, asyncio.LimitOverrunError) as exc:
        return Answer("malformed", detail=f"head: {exc}"[:200])
    try:
        body = await _read_body(reader, method, status, headers)
    except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
        return Answer("malformed", status, headers, detail=f"body cut short: {exc!r}"[:200])
    return Answer("answered", status, headers, body)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    while True:  # 100 Continue and other interim answers come before the real one
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        version, code, *_ = status_line.split(" ", 2)
        if version not in ("HTTP/1.0", "HTTP/1.1"):
            raise ValueError(f"not an HTTP/1.0 or 1.1 status line: {status_line[:80]!r}")
        status = int(code)
        if not 100 <= status < 200 or status == 101:
            break
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_body(
    reader: asyncio.StreamReader, method: str, status: int, headers: dict[str, str]
) -> bytes:
    if method == "HEAD" or status in (101, 204, 304):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return await _read_chunked(reader)
    if "content-length" in headers:
        return await reader.readexactly(min(int(headers["content-length"]), ANSWER_CAP))
    return await reader.read(ANSWER_CAP)  # until the server closes


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    size = 0
    while size <= ANSWER_CAP:
        line = await reader.readuntil(b"\r\n")
        length = int(line.split(b";")[0].strip(), 16)
        if length == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            break
        parts.append(await reader.readexactly(length))
        await reader.readexactly(2)
        size += length
    return b"".join(parts)
