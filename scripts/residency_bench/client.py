"""The load side: one streamed request (latency, time to first token, HTTP status), and the
stream replayed by a few clients pulling from it in order, bounded in count and time."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from scripts.residency_bench.stream import StreamRequest
from scripts.residency_bench.summary import RequestRecord

CHAT, COMPLETIONS = "chat", "completions"


def request_body(model: str, endpoint: str, prompt: str, max_tokens: int) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    record: RequestRecord,
    endpoint: str,
    prompt: str,
    max_tokens: int,
    started: float,
) -> RequestRecord:
    """Streams one request, filling ``record``; ``started`` is the stream's perf_counter origin."""
    path = "/v1/chat/completions" if endpoint == CHAT else "/v1/completions"
    t0 = time.perf_counter()
    record.start_s = t0 - started
    try:
        async with session.post(
            base_url + path, json=request_body(record.model, endpoint, prompt, max_tokens)
        ) as reply:
            record.status = reply.status
            if reply.status != 200:
                record.error = (await reply.text())[:200]
            else:
                done = False
                async for raw in reply.content:
                    line = raw.strip()
                    if not line.startswith(b"data: "):
                        continue
                    if line[6:] == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        record.error = str(chunk["error"].get("message"))[:200]
                        break
                    if any(_text(c) for c in chunk.get("choices") or []):
                        record.chunks += 1
                        if record.ttft_s is None:
                            record.ttft_s = time.perf_counter() - t0
                if record.error is None and not done:
                    record.error = "stream ended without [DONE]"
                elif record.error is None and record.ttft_s is None:
                    record.error = "no tokens received"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as error:
        record.error = f"{type(error).__name__}: {error}"[:200]
    record.latency_s = time.perf_counter() - t0
    return record


async def one_request(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    endpoint: str,
    prompt: str,
    max_tokens: int,
) -> RequestRecord:
    record = RequestRecord(index=-1, model=model, client=0, start_s=0.0)
    return await send(session, base_url, record, endpoint, prompt, max_tokens, time.perf_counter())


async def replay(
    session: aiohttp.ClientSession,
    base_url: str,
    stream: list[StreamRequest],
    endpoints: dict[str, str],
    clients: int,
    max_tokens: int,
    max_seconds: float,
) -> tuple[list[RequestRecord], float]:
    """``clients`` workers take the stream's requests in order, each sending its next when its
    last has finished, until the stream or ``max_seconds`` runs out (requests in flight then are
    cancelled and count as errors). Returns the records in stream order and the wall time."""
    queue = list(reversed(stream))
    records: list[RequestRecord] = []
    started = time.perf_counter()
    deadline = started + max_seconds

    async def worker(client: int) -> None:
        while queue and time.perf_counter() < deadline:
            spec = queue.pop()
            record = RequestRecord(spec.index, spec.model, client, 0.0)
            records.append(record)
            await send(
                session, base_url, record, endpoints[spec.model], spec.prompt, max_tokens, started
            )

    tasks = [asyncio.ensure_future(worker(c)) for c in range(clients)]
    _, pending = await asyncio.wait(tasks, timeout=max_seconds + 1)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - started
    for record in records:
        if record.latency_s is None:
            record.error = record.error or "cut at the time limit"
    return sorted(records, key=lambda r: r.index), duration
