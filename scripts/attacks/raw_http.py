"""The attacker's HTTP: one request on its own connection from ATTACKER_ADDRESS, the body sent
whole whatever it is, the answer read to EOF; and what an answer's figures are."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Distinct loopback sources: per-address limits tell attacker and victim apart, and the
# attacker's 20,000 ephemeral ports do not clash with anything else on 127.0.0.1.
VICTIM_ADDRESS = "127.0.0.2"
ATTACKER_ADDRESS = "127.0.0.3"


@dataclass
class Answer:
    status: int | None
    code: str | None
    seconds: float
    error: str | None = None
    body: bytes = field(default=b"", repr=False)

    def text(self) -> str:
        if self.status is None:
            return self.error or "no answer"
        return f"{self.status} {self.code}" if self.code else str(self.status)

    def brief(self) -> dict[str, Any]:
        return {"answer": self.text(), "seconds": round(self.seconds, 3)}


def error_code(body: bytes) -> str | None:
    """An OpenAI error body's code (or type), None for anything else."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return None
    return error.get("code") or error.get("type")


def dechunk(body: bytes) -> bytes:
    out, rest = [], body
    with contextlib.suppress(ValueError):
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out.append(rest[:size])
            rest = rest[size + 2 :]
    return b"".join(out)


def parse_response(raw: bytes) -> tuple[int | None, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None, b""
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    return status, body


async def http_request(
    base: str,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> Answer:
    """One request on its own connection (``Connection: close``), read to EOF within
    ``timeout``; the body is sent whole, whatever it is."""
    parts = urlsplit(base)
    extra = {"Content-Type": "application/json", **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n"
    head += f"Content-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in extra.items()) + "\r\n"
    chunks: list[bytes] = []
    error = None
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                parts.hostname, parts.port, local_addr=(ATTACKER_ADDRESS, 0)
            )
            try:
                writer.write(head.encode() + body)
                with contextlib.suppress(ConnectionError):  # may answer before reading it all
                    await writer.drain()
                while chunk := await reader.read(1 << 20):
                    chunks.append(chunk)
            finally:
                writer.close()
    except TimeoutError:
        error = "timeout"
    except OSError as exc:
        error = type(exc).__name__
    seconds = time.perf_counter() - t0
    status, payload = parse_response(b"".join(chunks))
    code = error_code(payload) if status is not None and status != 200 else None
    return Answer(status, code, seconds, None if status else error, payload)


def answer_figures(answer: Answer) -> dict[str, Any]:
    return {"answer": answer.text(), "answer_s": round(answer.seconds, 3)}
