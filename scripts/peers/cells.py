"""One cell of the comparison: one server, one concurrency, the seeded workload through
bench_serving's client, with the server process's resident memory sampled while it runs."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from common.processes import peak_rss_bytes, rss_bytes
from scripts.attacks.rss import MIB, RssSampler
from scripts.serving.client import Client, run_concurrency
from scripts.serving.workload import build_workload, tagged

ROLE = "server"


@dataclass(frozen=True)
class Target:
    """A running server: where to send requests, what to call the model, whose RSS to watch."""

    url: str
    model: str
    pid: int
    fresh_connections: bool = False  # llama-server: one connection per request


class _OneProcess:
    """The view of a fleet RssSampler needs: role -> PID."""

    def __init__(self, pid: int) -> None:
        self._pids = {ROLE: pid}

    def pids(self) -> dict[str, int]:
        return self._pids


def cell_specs(
    count: int, seed: int, input_words: tuple[int, int], output_len: int, tag: str
) -> list:
    """The same prompts for every configuration of a round; the tag keeps rounds and
    concurrencies from reusing each other's prompts out of a prefix cache."""
    return tagged(build_workload(count, seed, input_words, (output_len, output_len)), tag)


class CellRunner:
    """Runs cells against one target, sampling its VmRSS every 50 ms from start to close."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.client = Client(target.url, target.model, "completions", True, None)
        self.sampler = RssSampler(_OneProcess(target.pid))  # type: ignore[arg-type]
        self.sampler.start()

    def warmup(self, count: int, seed: int) -> None:
        if count:
            specs = build_workload(count, seed, (8, 16), (8, 8))
            asyncio.run(self._run(specs, count, 120))

    def run(self, specs: list, concurrency: int, max_seconds: float) -> dict:
        t0 = time.monotonic()
        run = asyncio.run(self._run(specs, concurrency, max_seconds))
        t1 = time.monotonic()
        end = rss_bytes(self.target.pid)  # a cell shorter than the sampling period has it
        peaks = [self.sampler.figures(ROLE, t0, t1)["peak_mb"], end and end / MIB]
        run["failed"] = run["errors"]  # unfinished_at_deadline: cut by --max-seconds, not failed
        run["rss_peak_mb"] = max((round(p, 1) for p in peaks if p), default=None)
        peak = peak_rss_bytes(self.target.pid)
        run["vm_hwm_mb"] = round(peak / MIB, 1) if peak is not None else None
        return run

    def _run(self, specs: list, concurrency: int, max_seconds: float):
        return run_concurrency(
            self.client, specs, concurrency, max_seconds, self.target.fresh_connections
        )

    def close(self) -> None:
        self.sampler.stop()
