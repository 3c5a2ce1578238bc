"""One ``modelyard serve`` process for one policy: its models.yaml, start and stop (and a check
that none of its engines outlived it), and the admin and metrics endpoints the benchmark reads."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from common.net import free_port
from common.processes import alive, cmdline, descendants, pss_bytes, rss_bytes, stop_process
from scripts.residency_bench.summary import Samples, parse_metrics

REPO = Path(__file__).resolve().parents[2]
MODELYARD = REPO / ".venv" / "bin" / "modelyard"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 90.0  # the gateway stops its engines first (each up to its drain and SIGTERM)
ADMIN_TIMEOUT_S = 600.0  # a load answers once the engine is ready (a cold start: tens of s)


def models_yaml(
    models: list[dict[str, Any]], cpu_bytes: int, park: bool, engine: dict[str, Any]
) -> dict[str, Any]:
    """The fleet document: every model on demand with an idle TTL no run reaches (only the
    budget evicts), with the engine settings in ``engine`` (kv_cache_memory, max_model_len,
    max_num_seqs, queue, idle_ttl_s)."""
    entries = []
    for model in models:
        entry = {
            "name": model["name"],
            "source": model["source"],
            "residency": "on_demand",
            "idle_ttl_s": engine["idle_ttl_s"],
            "kv_cache_memory": engine["kv_cache_memory"],
            "max_model_len": engine["max_model_len"],
            "max_num_seqs": engine["max_num_seqs"],
            "queue": engine["queue"],
        }
        if model.get("memory_estimate"):
            entry["memory_estimate"] = int(model["memory_estimate"])
        entries.append(entry)
    return {
        "gateway": {
            "watch_config": False,
            "access_log": False,
            "memory": {"cpu_bytes": int(cpu_bytes), "park": park},
        },
        "defaults": {"device": "cpu"},
        "models": entries,
    }


def _is_engine(pid: int) -> bool:
    argv = cmdline(pid)
    return "engine" in argv and "--served-model-name" in argv


class Gateway:
    """A gateway started on a free loopback port from ``document``; its stderr (log level info:
    the residency decisions) goes to ``log_dir/<name>.log``."""

    def __init__(self, name: str, document: dict[str, Any], log_dir: Path) -> None:
        self.name = name
        self.config = log_dir / f"{name}.models.yaml"
        # the engines' log files beside the gateway's, not in the user's cache folder
        gateway = {"engine_logs": {"dir": str(log_dir / f"{name}.engines")}, **document["gateway"]}
        document = {**document, "gateway": gateway}
        self.config.write_text(yaml.safe_dump(document, sort_keys=False))
        self.log_path = log_dir / f"{name}.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_pids: set[int] = set()
        self.session: aiohttp.ClientSession | None = None
        command = [str(MODELYARD), "serve", "-c", str(self.config)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "info"]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log
        )
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Until /health answers; then engine PIDs are tracked (every 0.5 s) until stop()."""
        timeout = aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway {self.name} exited: {self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.session.get(self.url + "/health") as reply:
                    if reply.status == 200:
                        self._watch = asyncio.ensure_future(self._track_engines())
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"gateway {self.name} not answering after {START_TIMEOUT_S}s")

    async def _track_engines(self) -> None:
        while self.proc.poll() is None:  # ends with the process (or when stop() cancels it)
            self.engine_pids |= set(descendants(self.proc.pid))
            await asyncio.sleep(0.5)

    def log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    # ---- endpoints ----

    async def get_json(self, path: str) -> Any:
        assert self.session is not None
        async with self.session.get(self.url + path) as reply:
            reply.raise_for_status()
            return await reply.json()

    async def admin(self, name: str, action: str) -> tuple[int, Any, float]:
        """POST /admin/models/{name}/{action}: status, body, seconds until it answered."""
        assert self.session is not None
        t0 = time.perf_counter()
        async with self.session.post(f"{self.url}/admin/models/{name}/{action}") as reply:
            body = await reply.json(content_type=None)
            self.engine_pids |= set(descendants(self.proc.pid))
            return reply.status, body, time.perf_counter() - t0

    async def models(self) -> dict[str, dict[str, Any]]:
        """/admin/models' entries by name."""
        return {m["name"]: m for m in (await self.get_json("/admin/models"))["models"]}

    async def metrics(self) -> Samples:
        assert self.session is not None
        async with self.session.get(self.url + "/metrics") as reply:
            return parse_metrics(await reply.text())

    async def footprint_change(
        self, name: str, key: str, before: int | None, timeout: float = 10.0
    ) -> int:
        """``footprint[key]`` of ``name`` once it differs from ``before`` (the gateway measures
        after the transition, in the background), or what it is after ``timeout``."""
        footprint = await self._footprint_once(name, lambda fp: fp[key] != before, timeout)
        return footprint[key]

    async def measured_footprint(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        """``name``'s footprint once the gateway has measured it (it does so in the background
        after the replica is ready), or as it is after ``timeout``."""
        return await self._footprint_once(name, lambda fp: fp["source"] == "measured", timeout)

    async def _footprint_once(
        self, name: str, done: Callable[[dict[str, Any]], bool], timeout: float
    ) -> dict[str, Any]:
        """``name``'s footprint once ``done`` holds for it, polled every 0.2 s, or as it is after
        ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            footprint = (await self.models())[name]["footprint"]
            if done(footprint) or time.monotonic() >= deadline:
                return footprint
            await asyncio.sleep(0.2)

    def engine_memory(self) -> tuple[int, int]:
        """What this gateway's engines hold now (/proc), whatever it plans: their summed RSS,
        and the summed PSS of every process under the gateway (engines, the engine templates
        they were forked from, compile workers), which counts the pages they share once."""
        under = descendants(self.proc.pid)
        rss = sum(rss_bytes(pid) or 0 for pid in under if _is_engine(pid))
        return rss, sum(pss_bytes(pid) or 0 for pid in under)

    async def timeline(self, started: float, interval: float, limit: int) -> list[dict[str, Any]]:
        """Samples every ``interval`` s (at most ``limit``) until cancelled: each model's state
        and planning footprint, what the gateway counts resident, and the engines' real RSS."""
        samples: list[dict[str, Any]] = []
        try:
            for _ in range(limit):
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    state = await self.get_json("/admin/models")
                    rss, pss = self.engine_memory()
                    samples.append(
                        {
                            "t_s": round(time.perf_counter() - started, 2),
                            "resident_bytes": state["memory"]["cpu_resident_bytes"],
                            "engine_rss_bytes": rss,
                            "engine_pss_bytes": pss,
                            "models": {
                                m["name"]: [
                                    m["state"],
                                    m["footprint"]["awake_bytes"],
                                    m["footprint"]["parked_bytes"],
                                ]
                                for m in state["models"]
                            },
                        }
                    )
                await asyncio.sleep(interval)
        except asyncio.CancelledError:
            pass
        return samples

    # ---- stop ----

    async def stop(self) -> dict[str, Any]:
        """SIGTERM, wait, SIGKILL if it will not go; then every engine it ran must be gone (any
        left is killed here and reported)."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self.proc.poll() is None:
            self.engine_pids |= set(descendants(self.proc.pid))
        if self.session is not None:
            await self.session.close()
        killed = await asyncio.to_thread(stop_process, self.proc, STOP_TIMEOUT_S)
        self._log.close()
        await asyncio.sleep(0.5)  # engines die with the gateway (PDEATHSIG) at the latest
        left = sorted(p for p in self.engine_pids if alive(p) and _is_engine(p))
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return {
            "gateway_exit_code": self.proc.returncode,
            "gateway_sigkilled": killed,
            "engine_pids_seen": sorted(self.engine_pids),
            "engines_left_running": left,
            "log": str(self.log_path),
        }
