"""llama-server's side: processes on the same file, each on a free loopback port with the same
context as an engine copy (``-c``, one unified KV cache for ``clients`` slots), started one by one
and given one request each while their summed RSS stays within the budget; then the same round
across them. Every process started is stopped at the end, whatever happened."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from common.processes import pss_bytes, rss_bytes
from scripts.density_bench.fill import fill_processes
from scripts.density_bench.round import request_round
from scripts.density_bench.settings import Settings
from scripts.peers.cells import Target
from scripts.peers.llama_server import LlamaServer, openmp_env
from scripts.serving.client import Client
from scripts.serving.results import RequestResult
from scripts.serving.workload import RequestSpec

log = logging.getLogger("bench_density")
LOAD_PROMPT = "Once upon a time"


@dataclass
class LlamaCopy:
    server: LlamaServer
    name: str
    ready_s: float
    first_request_s: float
    rss_bytes: int

    def stop(self) -> int | None:
        return self.server.stop()

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "pid": self.server.pid,
            "ready_s": round(self.ready_s, 3),
            "first_request_s": round(self.first_request_s, 3),
            "rss_after_first_request_bytes": self.rss_bytes,
            "rss_bytes": rss_bytes(self.server.pid),
            "pss_bytes": pss_bytes(self.server.pid),
        }


async def start_copy(
    s: Settings,
    binary: Path,
    threads: int,
    extra: list[str],
    index: int,
    started: list[LlamaServer],
) -> LlamaCopy:
    """Copy ``index``: spawned (and put in ``started`` at once, for the caller to stop), ready
    (/health), one request answered, its RSS read."""
    name = f"{s.model.name}-{index}"
    log_path = s.log_dir / f"llama-{index}.log"
    t0 = time.monotonic()
    server = LlamaServer.start(
        binary, s.model.path, name, threads, s.clients, s.context, log_path, openmp_env(), extra
    )
    started.append(server)
    await asyncio.to_thread(server.wait_ready, s.load_timeout)
    ready_s = time.monotonic() - t0
    result = RequestResult(ok=False, start=time.perf_counter())
    timeout = aiohttp.ClientTimeout(total=s.load_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = Client(server.url, name, "completions", True, None)
        await client.send(session, RequestSpec(LOAD_PROMPT, s.max_tokens), result)
    if not result.ok:
        raise RuntimeError(f"{name}: first request failed: {result.error}")
    first = time.perf_counter() - result.start
    rss = rss_bytes(server.pid) or 0
    log.info("llama: %s ready in %.1f s, RSS %.0f MiB", name, ready_s, rss / 2**20)
    return LlamaCopy(server, name, ready_s, first, rss)


async def run(s: Settings, binary: Path, threads: int, extra: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"context": s.context, "parallel": s.clients, "threads": threads}
    started: list[LlamaServer] = []
    try:
        copies, out["fill"] = await fill_processes(
            lambda i: start_copy(s, binary, threads, extra, i, started),
            s.budget_bytes,
            s.max_copies,
            s.fill_seconds,
        )
        if copies:
            out["command"] = copies[0].server.command
        out["copies"] = [c.describe() for c in copies]
        out["totals"] = {
            "copies": len(copies),
            "rss_bytes": sum(c["rss_bytes"] or 0 for c in out["copies"]),
            "pss_bytes": sum(c["pss_bytes"] or 0 for c in out["copies"]),
        }
        targets = [Target(c.server.url, c.name, c.server.pid, True) for c in copies]
        log.info("llama: request round across %d copies", len(targets))
        out["round"] = await request_round(
            targets, s.clients, s.requests, s.max_tokens, s.round_seconds
        )
    except Exception as error:  # recorded; the processes are stopped below
        log.exception("llama side failed")
        out["error"] = f"{type(error).__name__}: {error}"
    finally:
        for server in started:
            await asyncio.to_thread(server.stop)
        out["stopped_pids"] = [server.pid for server in started]
    return out
