"""The load generator's HTTP side: streaming requests to any OpenAI-compatible server, at fixed
concurrencies (closed loop) or at a Poisson request rate (open loop), each run time-bounded."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp

from scripts.serving.results import RequestResult, report
from scripts.serving.workload import RequestSpec


class Client:
    def __init__(
        self, base_url: str, model: str, endpoint: str, ignore_eos: bool, api_key: str | None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.ignore_eos = ignore_eos
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, spec: RequestSpec) -> dict:
        body = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM-style extra: fixed output lengths
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body

    async def send(
        self, session: aiohttp.ClientSession, spec: RequestSpec, result: RequestResult
    ) -> None:
        """Run one streaming request, filling ``result`` as chunks arrive (so a cancelled
        request still tells how far it got)."""
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        result.start = time.perf_counter()
        last = None
        try:
            async with session.post(
                self.base_url + path, json=self.body(spec), headers=self.headers
            ) as reply:
                if reply.status != 200:
                    result.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                    return
                async for raw in reply.content:
                    line = raw.strip()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        result.ok = True
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        result.error = str(chunk["error"].get("message"))[:200]
                        return
                    usage = chunk.get("usage")
                    if any(_choice_text(c) for c in chunk.get("choices") or []):
                        now = time.perf_counter()
                        result.output_tokens += 1  # one chunk per engine step and request
                        if last is None:
                            result.ttft = now - result.start
                        else:
                            result.itls.append(now - last)
                        last = now
                    if usage:
                        result.prompt_tokens = usage["prompt_tokens"]
                        result.output_tokens = usage["completion_tokens"]
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as error:
            result.error = f"{type(error).__name__}: {error}"[:200]
            result.ok = False
        result.end = time.perf_counter()
        if result.ok and result.ttft is None:
            result.ok, result.error = False, "no tokens received"


def _choice_text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def run_concurrency(
    client: Client,
    specs: list[RequestSpec],
    concurrency: int,
    max_seconds: float,
    fresh_connections: bool = False,
) -> dict:
    """Closed loop: ``concurrency`` workers, each sends its next request when one finishes.
    ``fresh_connections``: one connection per request, for servers (llama-server's cpp-httplib)
    whose HTTP worker threads a kept-alive idle connection would hold."""
    results: list[RequestResult] = []
    queue = list(reversed(specs))
    deadline = time.perf_counter() + max_seconds
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh_connections)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=max(max_seconds, 60))

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue and time.perf_counter() < deadline:
            results.append(RequestResult(ok=False, start=time.perf_counter()))
            await client.send(session, queue.pop(), results[-1])

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        workers = [asyncio.ensure_future(worker(session)) for _ in range(concurrency)]
        remaining = deadline - time.perf_counter()
        _, pending = await asyncio.wait(workers, timeout=max(remaining, 0) + 1)
        for task in pending:  # the time bound ends in-flight requests too
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - started
    extra = {"mode": "concurrency", "concurrency": concurrency, "cut_at_deadline": len(pending)}
    return report(results, duration, extra)


async def run_rate(
    client: Client, specs: list[RequestSpec], rate: float, seed: int, max_seconds: float
) -> dict:
    """Open loop: Poisson arrivals at ``rate`` requests/s, whatever the server's pace."""
    rng = random.Random(seed)
    results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=max(max_seconds, 60))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        deadline = started + max_seconds
        tasks = []

        async def one(spec: RequestSpec) -> None:
            results.append(RequestResult(ok=False, start=time.perf_counter()))
            await client.send(session, spec, results[-1])

        for spec in specs:
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.ensure_future(one(spec)))
            await asyncio.sleep(rng.expovariate(rate))
        remaining = max(deadline - time.perf_counter(), 0) + 1
        _, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - started
    extra = {
        "mode": "poisson",
        "request_rate": rate,
        "sent": len(tasks),
        "cut_at_deadline": len(pending),
    }
    return report(results, duration, extra)
