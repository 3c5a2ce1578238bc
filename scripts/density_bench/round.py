"""The request round with every copy awake: ``clients`` closed-loop workers send a seeded list of
streamed /v1/completions (fixed length: ignore_eos, temperature 0) to the copies in turn, bounded
in count and time: bench_serving's closed loop and report (latency p50/p99 is its ``e2e_s``),
with a router in place of its one client."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp

from scripts.peers.cells import Target
from scripts.serving.client import Client, run_concurrency
from scripts.serving.results import RequestResult
from scripts.serving.workload import RequestSpec, build_workload

INPUT_WORDS = (8, 32)


@dataclass
class RoutedSpec(RequestSpec):
    copy: int = 0  # the index of the target it goes to


class Router:
    """Stands in for run_concurrency's client: each request goes to its copy's client; the
    completed requests are counted per copy."""

    def __init__(self, targets: list[Target]) -> None:
        self.clients = [Client(t.url, t.model, "completions", True, None) for t in targets]
        self.completed: Counter[str] = Counter()

    async def send(
        self, session: aiohttp.ClientSession, spec: RoutedSpec, result: RequestResult
    ) -> None:
        client = self.clients[spec.copy]
        await client.send(session, spec, result)
        if result.ok:
            self.completed[client.model] += 1


def routed(specs: list[RequestSpec], copies: int) -> list[RoutedSpec]:
    """Request i to copy i mod ``copies``."""
    return [RoutedSpec(s.prompt, s.max_tokens, i % copies) for i, s in enumerate(specs)]


async def request_round(
    targets: list[Target],
    clients: int,
    count: int,
    max_tokens: int,
    max_seconds: float,
    seed: int = 0,
) -> dict[str, Any]:
    """Requests the time bound cuts count as unfinished; llama-server targets get one connection
    per request (Target.fresh_connections)."""
    if not targets:
        return {"skipped": "no copy awake"}
    specs = routed(build_workload(count, seed, INPUT_WORDS, (max_tokens, max_tokens)), len(targets))
    router = Router(targets)
    fresh = any(t.fresh_connections for t in targets)
    # the router has the one method run_concurrency calls on its client: send()
    out = await run_concurrency(router, specs, clients, max_seconds, fresh)  # type: ignore[arg-type]
    out.update(copies=len(targets), requests=count)
    out["completed_per_copy"] = dict(router.completed)
    return out
