"""Closed-loop streaming chat requests that keep each output's text (to validate it) and time it:
time to first token, then the decode rate of the rest."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Result:
    index: int  # of its body in the cell's list
    text: str = ""
    tokens: int = 0  # the server's usage figure
    start: float = 0.0
    first: float | None = None  # first content chunk
    end: float = 0.0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time they took: the stream's decode rate."""
        if self.first is None or self.tokens < 2 or self.end <= self.first:
            return None
        return (self.tokens - 1) / (self.end - self.first)


@dataclass
class Cell:
    results: list[Result] = field(default_factory=list)
    duration_s: float = 0.0


async def _send(session: aiohttp.ClientSession, url: str, body: dict, result: Result) -> None:
    result.start = time.perf_counter()
    try:
        async with session.post(url, json=body) as reply:
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                return
            async for raw in reply.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    content = choice["delta"].get("content") or ""
                    if content and result.first is None:
                        result.first = time.perf_counter()
                    result.text += content
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"[:200]
    result.end = time.perf_counter()


async def run_cell(base_url: str, bodies: list[dict], concurrency: int, max_seconds: float) -> Cell:
    """Send every body in order, `concurrency` at a time, within `max_seconds`."""
    url = base_url + "/v1/chat/completions"
    queue = list(reversed(list(enumerate(bodies))))
    cell = Cell()
    deadline = time.perf_counter() + max_seconds
    timeout = aiohttp.ClientTimeout(total=None, sock_read=max(max_seconds, 60))

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue and time.perf_counter() < deadline:
            index, body = queue.pop()
            cell.results.append(Result(index))
            await _send(session, url, body, cell.results[-1])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(*(worker(session) for _ in range(concurrency))), max_seconds + 60
        )
        cell.duration_s = time.perf_counter() - started
    return cell
