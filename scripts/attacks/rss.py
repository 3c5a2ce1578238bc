"""The resident sets of the gateway and the engine (with its descendants: it may run workers)
every 50 ms, in its own thread; the peak in a window."""

from __future__ import annotations

import threading
import time

from common.processes import TreeRss, rss_bytes
from scripts.attacks.fleet import Fleet
from scripts.attacks.victim import RUN_CAP_S

RSS_EVERY_S = 0.05
MIB = 2**20


class RssSampler:
    """The resident set of the gateway (its own: the engine is its child) and of the engine and
    its descendants, every 50 ms, in bytes."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.samples: list[tuple[float, str, int]] = []
        self._engine = TreeRss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        deadline = time.monotonic() + RUN_CAP_S
        while not self._stop.wait(RSS_EVERY_S) and time.monotonic() < deadline:
            for role, pid in self.fleet.pids().items():
                rss = self._engine.rss_bytes(pid) if role == "engine" else rss_bytes(pid)
                if rss is not None:
                    self.samples.append((time.monotonic(), role, rss))

    def growth_mb(self, role: str) -> float:
        """The latest sample over the first one (0 without samples)."""
        samples = [rss for _, r, rss in list(self.samples) if r == role]
        return (samples[-1] - samples[0]) / MIB if samples else 0.0

    def figures(self, role: str, t0: float, t1: float) -> dict[str, float | None]:
        samples = list(self.samples)
        before = [rss for t, r, rss in samples if r == role and t < t0]
        pad = RSS_EVERY_S  # a window shorter than the period still gets its neighbours
        during = [rss for t, r, rss in samples if r == role and t0 - pad <= t <= t1 + pad]
        after = [rss for t, r, rss in samples if r == role and t <= t1 + pad]
        return {
            "before_mb": round(before[-1] / MIB, 1) if before else None,
            "peak_mb": round(max(during) / MIB, 1) if during else None,
            "end_mb": round(after[-1] / MIB, 1) if after else None,
        }
