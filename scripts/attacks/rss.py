"""VmRSS of the gateway and the engine every 50 ms, in its own thread; the peak in a window."""

from __future__ import annotations

import threading
import time

from scripts.attacks.fleet import Fleet
from scripts.attacks.procfs import vm_rss_kb
from scripts.attacks.victim import RUN_CAP_S

RSS_EVERY_S = 0.05


class RssSampler:
    """VmRSS of the gateway and the engine every 50 ms."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.samples: list[tuple[float, str, int]] = []
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
                kb = vm_rss_kb(pid)
                if kb is not None:
                    self.samples.append((time.monotonic(), role, kb))

    def figures(self, role: str, t0: float, t1: float) -> dict[str, float | None]:
        samples = list(self.samples)
        before = [kb for t, r, kb in samples if r == role and t < t0]
        pad = RSS_EVERY_S  # a window shorter than the period still gets its neighbours
        during = [kb for t, r, kb in samples if r == role and t0 - pad <= t <= t1 + pad]
        return {
            "before_mb": round(before[-1] / 1024, 1) if before else None,
            "peak_mb": round(max(during) / 1024, 1) if during else None,
        }
