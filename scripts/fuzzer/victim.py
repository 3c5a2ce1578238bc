"""Another client beside the structured fuzz, and the server's memory meanwhile: in a thread with
its own event loop, so that the fuzz's own work (MB bodies built, outputs validated) never delays
its clock. It sends a plain request again and again, each on a new connection, to wherever the
server is now (a restart moves it), and samples the server's RSS with its descendants (workers
it may run)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Protocol

from common.processes import TreeRss
from scripts.attacks.loop_thread import LoopThread
from scripts.fuzzer.exchange import exchange
from scripts.fuzzer.request import Case
from scripts.measure import percentile

PAUSE_S = 0.1  # between two requests: the CPUs are shared
RSS_EVERY_S = 0.1
CAP_S = 7200.0  # the thread stops by itself after this
NO_LATENCY = ("refused", "closed")


class Where(Protocol):
    host: str
    port: int
    pid: int


class Victim(LoopThread):
    def __init__(self, server: Where, case: Case, timeout_s: float = 20.0) -> None:
        super().__init__()
        self.server, self.case, self.timeout_s = server, case, timeout_s
        self.requests: list[tuple[float, str]] = []  # (seconds, outcome: "200", "503", "timeout")
        self.rss_samples: list[int] = []  # bytes
        self._tree = TreeRss()

    async def main(self) -> None:
        deadline = time.monotonic() + CAP_S
        await asyncio.gather(self._requests(deadline), self._rss(deadline))

    async def _requests(self, deadline: float) -> None:
        while not self.stopping.is_set() and time.monotonic() < deadline:
            t0 = time.monotonic()
            answer = await exchange(self.server.host, self.server.port, self.case, self.timeout_s)
            outcome = str(answer.status) if answer.status else answer.outcome
            self.requests.append((time.monotonic() - t0, outcome))
            await asyncio.sleep(PAUSE_S)

    async def _rss(self, deadline: float) -> None:
        while not self.stopping.is_set() and time.monotonic() < deadline:
            rss = self._tree.rss_bytes(self.server.pid)
            if rss is not None:
                self.rss_samples.append(rss)
            await asyncio.sleep(RSS_EVERY_S)

    def stats(self) -> dict[str, Any]:
        """Its requests' count, successes, failures by outcome and the latency percentiles of
        those that got an answer or timed out (at the time they waited): a refused or closed
        connection is a failure, but its few microseconds are no latency."""
        latencies = [s * 1000 for s, o in self.requests if o not in NO_LATENCY]
        failures = Counter(o for _, o in self.requests if o != "200")

        def ms(q: float) -> float | None:
            value = percentile(latencies, q)
            return round(value, 1) if value is not None else None

        return {
            "count": len(self.requests),
            "ok": len(self.requests) - sum(failures.values()),
            "failures": dict(failures.most_common()),
            "p50_ms": ms(50),
            "p99_ms": ms(99),
            "max_ms": ms(100),
        }

    def rss_mib(self) -> dict[str, float | None]:
        """The server's RSS with its descendants: first sample and peak."""
        if not self.rss_samples:
            return {"first": None, "peak": None}
        return {
            "first": round(self.rss_samples[0] / 2**20, 1),
            "peak": round(max(self.rss_samples) / 2**20, 1),
        }
