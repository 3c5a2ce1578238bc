"""The victim: another tenant's small chats through the gateway and /health polls of both
servers, in its own thread (an attack's work must not distort it), every request on a new
connection; and the figures of its requests in a time window."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp

from scripts.attacks.fleet import MODEL, Fleet
from scripts.attacks.loop_thread import LoopThread
from scripts.attacks.raw_http import CHAT, error_code
from scripts.measure import percentile

VICTIM_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
).encode()
VICTIM_TIMEOUT_S = 20.0
VICTIM_PAUSE_S = 0.1  # between one victim worker's requests: the CPUs are shared
HEALTH_EVERY_S = 0.1
RUN_CAP_S = 3600.0  # victim and sampler threads stop by themselves after this


@dataclass
class Probe:
    start: float
    end: float | None = None
    outcome: str = "in flight"

    @property
    def ok(self) -> bool:
        return self.outcome == "200"

    def latency(self, now: float) -> float:
        return (self.end or now) - self.start


def overlapping(probes: list[Probe], t0: float, t1: float) -> list[Probe]:
    return [p for p in list(probes) if p.start < t1 and (p.end is None or p.end > t0)]


async def finished(probes: list[Probe]) -> list[Probe]:
    """The probes once they have ended (a victim request times out after VICTIM_TIMEOUT_S)."""
    deadline = time.monotonic() + VICTIM_TIMEOUT_S + 1
    while any(p.end is None for p in probes) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return probes


def probe_stats(probes: list[Probe]) -> dict[str, Any]:
    now = time.monotonic()
    latencies = [p.latency(now) * 1000 for p in probes]
    failures = Counter(p.outcome for p in probes if not p.ok)
    return {
        "count": len(probes),
        "ok": sum(p.ok for p in probes),
        "failures": dict(failures.most_common()),
        "p50_ms": round(percentile(latencies, 50), 1) if latencies else None,
        "p99_ms": round(percentile(latencies, 99), 1) if latencies else None,
        "max_ms": round(max(latencies), 1) if latencies else None,
    }


class Victim(LoopThread):
    """Another tenant: ``concurrency`` workers sending small chat requests through the gateway,
    and pollers of the gateway's and the engine's /health; every request on a new connection."""

    def __init__(self, fleet: Fleet, concurrency: int, source: str) -> None:
        super().__init__()
        self.fleet, self.concurrency, self.source = fleet, concurrency, source
        self.chats: list[Probe] = []
        self.health: dict[str, list[Probe]] = {"gateway": [], "engine": []}
        self._deadline = time.monotonic() + RUN_CAP_S

    def _running(self) -> bool:
        return not self.stopping.is_set() and time.monotonic() < self._deadline

    async def main(self) -> None:
        connector = aiohttp.TCPConnector(force_close=True, limit=0, local_addr=(self.source, 0))
        timeout = aiohttp.ClientTimeout(total=VICTIM_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            workers = [self._chat_loop(session) for _ in range(self.concurrency)]
            pollers = [self._health_loop(session, name) for name in self.health]
            await asyncio.gather(*workers, *pollers)

    async def _probe(
        self, session: aiohttp.ClientSession, url: str, body: bytes | None, record: list[Probe]
    ) -> None:
        probe = Probe(time.monotonic())
        record.append(probe)  # listed while in flight: a stalled request shows
        try:
            method = "POST" if body else "GET"
            headers = {"Content-Type": "application/json"}
            async with session.request(method, url, data=body, headers=headers) as resp:
                raw = await resp.read()
                probe.outcome = "200" if resp.status == 200 else f"{resp.status} {error_code(raw)}"
        except TimeoutError:
            probe.outcome = "timeout"
        except (aiohttp.ClientError, OSError) as exc:
            probe.outcome = type(exc).__name__
        probe.end = time.monotonic()

    async def _chat_loop(self, session: aiohttp.ClientSession) -> None:
        while self._running():
            await self._probe(session, self.fleet.url + CHAT, VICTIM_BODY, self.chats)
            await asyncio.sleep(VICTIM_PAUSE_S)

    async def _health_loop(self, session: aiohttp.ClientSession, name: str) -> None:
        while self._running():
            base = self.fleet.url if name == "gateway" else self.fleet.engine_url
            await self._probe(session, base + "/health", None, self.health[name])
            await asyncio.sleep(HEALTH_EVERY_S)

    def first_ok_since(self, t: float) -> Probe | None:
        return next((p for p in list(self.chats) if p.start >= t and p.ok), None)
