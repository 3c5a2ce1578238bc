#!/usr/bin/env python
"""Denial-of-service benchmark: known attacks replayed against a real `modelyard serve` (gateway
plus its engine) while a victim client keeps sending valid requests, JSON out.

Each run starts the gateway from a checkout (``--repo``, default this one) with a temporary
models.yaml (the SmolLM2 GGUF, one replica, 256 MiB KV cache, max_num_seqs 8) on a free
loopback port, finds its engine (``/admin/prometheus/targets``, the gateway's child in /proc)
and replays, one after another (3 first, see ATTACKS): (1) a deflate bomb (1 MiB -> 1 GiB) and
gzip'd 256 MiB of spaces, to the gateway and the engine; (2) ``n=10000`` on /v1/completions,
the client giving up after 10 s; (3) rounds of engine-500 bodies (``"role": ["user"]``) that
may eject the only backend; (4) a 4 MB prompt (chat and completion, gateway and engine);
(5) slow clients (header and body at 1 byte / 2 s, an idle keep-alive connection) and
``--connections`` silent connections; (6) small poison bodies; all from 127.0.0.3. Meanwhile a
victim (its own thread, from 127.0.0.2, a fresh connection per request) sends small chat
requests and polls both ``/health`` endpoints, and /proc/PID/status VmRSS of both processes is
sampled every 50 ms. Per attack: the attack's answer, the victim's requests during and right
after it, the max /health latency (during and right after) and the peak RSS.

``--compare BASELINE`` runs BASELINE first, then ``--repo``, and adds ``side_by_side``: each
figure for both, with baseline/current ratios for times and sizes (``_ms``, ``_s``, ``_mb``).
Every loop is bounded in count and time; a failed attack is reported, not fatal.

    git worktree add --detach /tmp/modelyard-baseline c1242b8
    .venv/bin/python scripts/bench_attacks.py --compare /tmp/modelyard-baseline \\
        --out bench-results/attacks.json
    .venv/bin/python scripts/bench_attacks.py --only 1a,5a --slow-cap-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import platform
import re
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script: make `common` and `scripts` importable

from common.net import free_port  # noqa: E402
from scripts.measure import percentile  # noqa: E402

MODEL = "smollm2"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_NUM_SEQS = 8
# Distinct loopback sources: per-address limits tell attacker and victim apart, and the
# attacker's 20,000 ephemeral ports do not clash with anything else on 127.0.0.1.
VICTIM_ADDRESS = "127.0.0.2"
ATTACKER_ADDRESS = "127.0.0.3"
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux: port at connect
VICTIM_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
).encode()
VICTIM_TIMEOUT_S = 20.0
VICTIM_PAUSE_S = 0.1  # between one victim worker's requests: the CPUs are shared
HEALTH_EVERY_S = 0.1
RSS_EVERY_S = 0.05
RUN_CAP_S = 1800.0  # victim and sampler threads stop by themselves after this
ATTACK_CAP_S = 300.0
SETTLE_CAP_S = 90.0
RECOVERY_CAP_S = 120.0
ROUND_CAP_S = 45.0
QUIET_S = 3.0  # a round with no 503 for this long (and a victim success) ejected nothing
CONNECT_WAIT_S = 15.0  # covers SYN retransmits (1 s, 3 s, 7 s) when the accept queue is full
FD_RESERVE = 64
ENGINE_GONE_S = 10.0
CONNECT_BATCH = 500  # below the gateway's listen backlog (2048)
RATIO_SUFFIXES = ("_ms", "_s", "_mb")
ROLE_LIST_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": ["user"], "content": "hi"}], "max_tokens": 4}
).encode()


# ---- raw HTTP (the attacker's side) -----------------------------------------------------------


@dataclass
class Answer:
    status: int | None
    code: str | None
    seconds: float
    error: str | None = None
    body: bytes = field(default=b"", repr=False)

    def text(self) -> str:
        if self.status is None:
            return self.error or "no answer"
        return f"{self.status} {self.code}" if self.code else str(self.status)

    def brief(self) -> dict[str, Any]:
        return {"answer": self.text(), "seconds": round(self.seconds, 3)}


def error_code(body: bytes) -> str | None:
    """An OpenAI error body's code (or type), None for anything else."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return None
    return error.get("code") or error.get("type")


def dechunk(body: bytes) -> bytes:
    out, rest = [], body
    with contextlib.suppress(ValueError):
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out.append(rest[:size])
            rest = rest[size + 2 :]
    return b"".join(out)


def parse_response(raw: bytes) -> tuple[int | None, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None, b""
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    return status, body


async def http_request(
    base: str,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> Answer:
    """One request on its own connection (``Connection: close``), read to EOF within
    ``timeout``; the body is sent whole, whatever it is."""
    parts = urlsplit(base)
    extra = {"Content-Type": "application/json", **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n"
    head += f"Content-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in extra.items()) + "\r\n"
    chunks: list[bytes] = []
    error = None
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                parts.hostname, parts.port, local_addr=(ATTACKER_ADDRESS, 0)
            )
            try:
                writer.write(head.encode() + body)
                with contextlib.suppress(ConnectionError):  # may answer before reading it all
                    await writer.drain()
                while chunk := await reader.read(1 << 20):
                    chunks.append(chunk)
            finally:
                writer.close()
    except TimeoutError:
        error = "timeout"
    except OSError as exc:
        error = type(exc).__name__
    seconds = time.perf_counter() - t0
    status, payload = parse_response(b"".join(chunks))
    code = error_code(payload) if status is not None and status != 200 else None
    return Answer(status, code, seconds, None if status else error, payload)


# ---- the fleet under attack -------------------------------------------------------------------


def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; returns it."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def proc_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def proc_cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def find_engine_pid(gateway_pid: int, port: int) -> int | None:
    """The engine listening on ``port``: a descendant of the gateway (its launcher execs it)."""
    todo = children(gateway_pid)
    for _ in range(1000):  # bounded walk of the process tree
        if not todo:
            return None
        pid = todo.pop()
        cmd = proc_cmdline(pid)
        if "engine" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port):
            return pid
        todo += children(pid)
    return None


def vm_rss_kb(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def open_fds(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


def fd_limit(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
    return None


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def checkout_state(repo: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        cmd = ["git", "--no-optional-locks", "-C", str(repo), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "--short", "HEAD"), "changed_files": len(changed.split())}


class Fleet:
    """`modelyard serve` from ``repo`` (cwd and PYTHONPATH, so that its code imports, not the
    venv's editable install), and the engine it spawns."""

    def __init__(self, repo: Path, workdir: Path, model: Path) -> None:
        self.repo, self.workdir, self.model = repo, workdir, model
        self.env = dict(os.environ, PYTHONPATH=str(repo))
        self.log = workdir / "gateway.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.engine_url = ""
        self.engine_pid: int | None = None
        self.engine_pids_seen: set[int] = set()

    def imports(self) -> dict[str, str]:
        code = (
            "import engine, gateway, json; print(json.dumps([engine.__file__, gateway.__file__]))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=self.repo,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        engine_file, gateway_file = json.loads(out)
        for path in (engine_file, gateway_file):
            if not Path(path).resolve().is_relative_to(self.repo):
                raise RuntimeError(f"{path} imports instead of the code in {self.repo}")
        return {"engine.__file__": engine_file, "gateway.__file__": gateway_file}

    def start(self, ready_timeout: float) -> None:
        config = self.workdir / "models.yaml"
        model = {
            "name": MODEL,
            "source": str(self.model),
            "replicas": 1,
            "kv_cache_memory": "256MiB",
            "max_num_seqs": MAX_NUM_SEQS,
        }
        gateway = {"access_log": False, "watch_config": False}
        config.write_text(json.dumps({"gateway": gateway, "models": [model]}, indent=2))  # YAML
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config), "--port", str(port)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.repo, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + ready_timeout
        engine_seen = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}; see {self.log}")
            if children(self.proc.pid):
                engine_seen = time.monotonic()
            elif time.monotonic() - engine_seen > ENGINE_GONE_S:  # a failed first start is final
                raise RuntimeError(f"the engine exited before it was ready; see {self.log}")
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                urllib.request.urlopen(self.url + "/ready", timeout=2).read()
                self.refresh()
                return
            time.sleep(0.5)
        raise RuntimeError(f"gateway not ready after {ready_timeout} s; see {self.log}")

    def refresh(self) -> None:
        """The engine's address (it changes if the gateway restarted it) and PID."""
        groups = get_json(self.url + "/admin/prometheus/targets")
        address = next(g["targets"][0] for g in groups if g["labels"].get("kind") == "local")
        pid = find_engine_pid(self.proc.pid, int(address.rsplit(":", 1)[1]))
        if pid is None:
            raise RuntimeError(f"no engine process for {address} under PID {self.proc.pid}")
        self.engine_url, self.engine_pid = f"http://{address}", pid
        self.engine_pids_seen.add(pid)

    def pids(self) -> dict[str, int]:
        pids = {"gateway": self.proc.pid} if self.proc else {}
        if self.engine_pid:
            pids["engine"] = self.engine_pid
        return pids

    def stop(self) -> dict[str, Any]:
        """SIGTERM to the gateway (it stops its engines); then any engine still there, by PID."""
        if self.proc is None:
            return {}
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(map(proc_alive, self.engine_pids_seen)):
            time.sleep(0.2)
        left = [pid for pid in self.engine_pids_seen if proc_alive(pid)]
        for pid in left:
            if "engine" in proc_cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        return {"gateway_exit_code": self.proc.returncode, "engines_left_and_killed": left}


# ---- victim and sampler (own threads, so an attack's work does not distort them) ---------------


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
        "max_ms": round(max(latencies), 1) if latencies else None,
    }


class Victim:
    """Another tenant: ``concurrency`` workers sending small chat requests through the gateway,
    and pollers of the gateway's and the engine's /health; every request on a new connection."""

    def __init__(self, fleet: Fleet, concurrency: int, source: str) -> None:
        self.fleet, self.concurrency, self.source = fleet, concurrency, source
        self.chats: list[Probe] = []
        self.health: dict[str, list[Probe]] = {"gateway": [], "engine": []}
        self._stop = threading.Event()
        self._deadline = time.monotonic() + RUN_CAP_S
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(VICTIM_TIMEOUT_S + 5)

    def _running(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self._deadline

    async def _main(self) -> None:
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


@dataclass
class Ctx:
    fleet: Fleet
    victim: Victim
    sampler: RssSampler
    args: argparse.Namespace
    payloads: dict[str, bytes]


# ---- attacks ----------------------------------------------------------------------------------


def compressed(size: int, wbits: int) -> bytes:
    """``size`` bytes of spaces, compressed in 1 MiB steps (never whole in memory)."""
    step = b" " * (1 << 20)
    comp = zlib.compressobj(9, zlib.DEFLATED, wbits)
    parts = [comp.compress(step) for _ in range(size // len(step))]
    return b"".join(parts) + comp.flush()


def build_payloads() -> dict[str, bytes]:
    words = itertools.cycle(["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "elit"])
    prompt = " ".join(itertools.islice(words, 700_000))[:4_000_000]
    return {
        "deflate_bomb": compressed(1 << 30, 15),  # zlib stream: HTTP's "deflate"
        "gzip_spaces": compressed(256 << 20, 31),
        "big_chat": json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
        ).encode(),
        "big_completion": json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode(),
    }


def answer_figures(answer: Answer) -> dict[str, Any]:
    return {"answer": answer.text(), "answer_s": round(answer.seconds, 3)}


def encoded_body(payload: str, encoding: str, target: str) -> Callable[[Ctx], Awaitable[dict]]:
    async def attack(ctx: Ctx) -> dict[str, Any]:
        base = ctx.fleet.url if target == "gateway" else ctx.fleet.engine_url
        body = ctx.payloads[payload]
        answer = await http_request(base, "POST", CHAT, body, {"Content-Encoding": encoding}, 60)
        return {"body_bytes": len(body), **answer.brief(), "figures": answer_figures(answer)}

    return attack


def big_prompt(payload: str, path: str, target: str) -> Callable[[Ctx], Awaitable[dict]]:
    async def attack(ctx: Ctx) -> dict[str, Any]:
        base = ctx.fleet.url if target == "gateway" else ctx.fleet.engine_url
        body = ctx.payloads[payload]
        answer = await http_request(base, "POST", path, body, timeout=60)
        return {"body_bytes": len(body), **answer.brief(), "figures": answer_figures(answer)}

    return attack


async def engine_waiting(ctx: Ctx) -> float | None:
    answer = await http_request(ctx.fleet.engine_url, "GET", "/metrics", timeout=5)
    for line in answer.body.decode(errors="replace").splitlines():
        if line.startswith("vllm:num_requests_waiting"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def many_choices(ctx: Ctx) -> dict[str, Any]:
    """n=10000 through the gateway, given up after --give-up-s; then, from its answer (or the
    give-up), how long the engine keeps more than max_num_seqs requests waiting and how long the
    victim's requests keep failing."""
    t0 = time.monotonic()
    samples: list[tuple[float, float]] = []

    async def poll_metrics() -> None:
        while True:  # cancelled below, after at most RECOVERY_CAP_S
            value = await engine_waiting(ctx)
            if value is not None:
                samples.append((time.monotonic(), value))
            await asyncio.sleep(0.25)

    def high_until() -> float:
        return max((t for t, v in samples if v > MAX_NUM_SEQS), default=t0)

    def failing_until() -> float:
        chats = [p for p in list(ctx.victim.chats) if p.start >= t0 and p.end is not None]
        return max((p.end for p in chats if not p.ok), default=t0)

    def recovered() -> bool:
        queue_low = bool(samples) and samples[-1][0] > high_until()
        return queue_low and ctx.victim.first_ok_since(failing_until()) is not None

    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": 10000}).encode()
    poller = asyncio.create_task(poll_metrics())
    try:
        answer = await http_request(
            ctx.fleet.url, "POST", COMPLETIONS, body, timeout=ctx.args.give_up_s
        )
        answered = time.monotonic()
        while time.monotonic() < answered + RECOVERY_CAP_S and not recovered():
            await asyncio.sleep(0.25)
    finally:
        poller.cancel()
    figures = {
        **answer_figures(answer),
        "waiting_max": max((v for _, v in samples), default=None),
        "waiting_high_after_answer_s": round(max(0.0, high_until() - answered), 2),
        "victim_failing_after_answer_s": round(max(0.0, failing_until() - answered), 2),
    }
    capped = {} if recovered() else {"capped_at_s": RECOVERY_CAP_S}
    return {
        **answer.brief(),
        "waiting_high_means": f"> {MAX_NUM_SEQS}",
        **capped,
        "figures": figures,
    }


async def ejection_round(ctx: Ctx, bodies: int) -> dict[str, Any]:
    """``bodies`` engine-500 bodies at once, then the victim's 503 no_healthy_backend window:
    from its first such 503 to the start of its next request that succeeds."""
    t0 = time.monotonic()
    answers = await asyncio.gather(
        *(
            http_request(ctx.fleet.url, "POST", CHAT, ROLE_LIST_BODY, timeout=30)
            for _ in range(bodies)
        )
    )
    result: dict[str, Any] = {"answers": dict(Counter(a.text() for a in answers))}
    while time.monotonic() < t0 + ROUND_CAP_S:
        await asyncio.sleep(0.2)
        probes = [p for p in list(ctx.victim.chats) if p.start >= t0 and p.end is not None]
        nhb = [p for p in probes if p.outcome == "503 no_healthy_backend"]
        if not nhb:
            if time.monotonic() - t0 >= QUIET_S and any(p.ok for p in probes):
                return {**result, "window_s": 0.0, "victim_503s": 0}
            continue
        ok_after = [p for p in probes if p.ok and p.start > nhb[0].start]
        if ok_after:
            window = ok_after[0].start - nhb[0].start
            return {**result, "window_s": round(window, 2), "victim_503s": len(nhb)}
    return {**result, "window_s": ROUND_CAP_S, "capped": True}


async def ejection(ctx: Ctx) -> dict[str, Any]:
    rounds = [await ejection_round(ctx, ctx.args.bodies_per_round) for _ in range(ctx.args.rounds)]
    figures: dict[str, Any] = {}
    for i, r in enumerate(rounds, 1):
        figures[f"round{i}_answers"] = ", ".join(f"{k} x{v}" for k, v in r["answers"].items())
        figures[f"round{i}_503_window_s"] = r["window_s"]
    return {"rounds": rounds, "figures": figures}


def slow_bytes(kind: str, host: str) -> tuple[bytes, Iterator[bytes]]:
    """What a slow client sends at once, and then one byte at a time."""
    if kind == "header":
        head = f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode()
        return b"", itertools.chain(
            (head[i : i + 1] for i in range(len(head))), itertools.repeat(b"a")
        )
    if kind == "body":
        head = f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        head += "Content-Length: 1000\r\n\r\n"
        return head.encode(), itertools.repeat(b" ")
    return f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(), iter(())


async def slow_client(base: str, kind: str, cap: float, interval: float = 2.0) -> dict[str, Any]:
    """How long the server keeps a slow client's connection open (up to ``cap``)."""
    parts = urlsplit(base)
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(
        parts.hostname, parts.port, local_addr=(ATTACKER_ADDRESS, 0)
    )
    first, trickle = slow_bytes(kind, parts.netloc)
    received: list[bytes] = []

    async def read_all() -> None:
        with contextlib.suppress(OSError):
            while chunk := await reader.read(65536):
                received.append(chunk)

    reading = asyncio.create_task(read_all())
    write_error = None
    try:
        writer.write(first)
        while not reading.done() and time.monotonic() - t0 < cap:
            if kind != "idle":
                writer.write(next(trickle))
                await writer.drain()
            remaining = cap - (time.monotonic() - t0)
            await asyncio.wait({reading}, timeout=max(0.0, min(interval, remaining)))
    except OSError as exc:
        write_error = type(exc).__name__
    open_s = time.monotonic() - t0
    closed = reading.done() or write_error is not None
    reading.cancel()
    writer.close()
    statuses = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3})", b"".join(received))]
    return {"open_s": round(open_s, 1), "closed_by_server": closed, "statuses": statuses}


async def slow_clients(ctx: Ctx) -> dict[str, Any]:
    cap = ctx.args.slow_cap_s
    targets = {"gateway": ctx.fleet.url, "engine": ctx.fleet.engine_url}
    keys = [(t, k) for t in targets for k in ("header", "body", "idle")]
    results = await asyncio.gather(
        *(slow_client(targets[t], k, cap) for t, k in keys), return_exceptions=True
    )
    out: dict[str, Any] = {"cap_s": cap}
    figures: dict[str, Any] = {}
    for (target, kind), result in zip(keys, results, strict=True):
        name = f"{target}_{kind}"
        if isinstance(result, BaseException):
            out[name] = {"error": repr(result)}
            continue
        out[name] = result
        figures[f"{name}_open_s"] = result["open_s"]
        if not result["closed_by_server"]:
            figures[f"{name}_open_s"] = f">= {cap:g}"
    return {**out, "figures": figures}


def server_side(sock: socket.socket) -> str:
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return "open_silent"
    except OSError:
        return "reset"
    return "answered" if data else "closed"


def hold_connections(host: str, port: int, count: int, server_pid: int, conn: Any) -> None:
    """In a spawned process (its own file limit): open ``count`` silent connections as fast as
    the server accepts them, report, hold them until told, report what the server did to them,
    close. Paced by batches: past a full accept queue the kernel completes connections that the
    server never sees (SYN cookies), which would hold no server file."""
    limit = raise_nofile()
    socks: list[socket.socket] = []
    error = None
    try:
        try:
            while len(socks) < count:
                batch = min(CONNECT_BATCH, count - len(socks))
                target = (open_fds(server_pid) or 0) + batch - 50  # 50: others' connections
                for _ in range(batch):
                    sock = socket.socket()
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                    sock.bind((ATTACKER_ADDRESS, 0))
                    sock.connect_ex((host, port))
                    socks.append(sock)
                wait_accepted(server_pid, target)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        established = await_connected(socks, CONNECT_WAIT_S)
        conn.send(
            {"opened": len(socks), "established": established, "limit": limit, "error": error}
        )
        if conn.poll(ATTACK_CAP_S):
            conn.recv()
        conn.send(dict(Counter(server_side(s) for s in socks)))
    finally:
        for sock in socks:
            sock.close()


def wait_accepted(pid: int, target: int, cap: float = 5.0, stall: float = 0.5) -> None:
    """Until the server holds ``target`` files, or has taken none more for ``stall`` s (its
    limit)."""
    t0 = time.monotonic()
    most, grew_at = open_fds(pid) or 0, t0
    while time.monotonic() < t0 + cap and most < target:
        time.sleep(0.02)
        fds = open_fds(pid) or 0
        if fds > most:
            most, grew_at = fds, time.monotonic()
        elif time.monotonic() - grew_at > stall:
            return


def await_connected(socks: list[socket.socket], timeout: float) -> int:
    established = 0
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_WRITE)
        pending = len(socks)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for key, _ in selector.select(max(0.0, deadline - time.monotonic())):
                selector.unregister(key.fileobj)
                pending -= 1
                established += key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    return established


async def local_victim(ctx: Ctx, seconds: float) -> dict[str, Any]:
    """Victim requests from the attacker's own address, one after another."""
    answers: list[Answer] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(answers) < 20:
        answers.append(await http_request(ctx.fleet.url, "POST", CHAT, VICTIM_BODY, timeout=5))
    return {"count": len(answers), "answers": dict(Counter(a.text() for a in answers))}


async def half_open(ctx: Ctx) -> dict[str, Any]:
    """--connections silent connections to the gateway, held --hold-s."""
    t0 = time.monotonic()
    total = ctx.args.connections
    per_process = raise_nofile() - FD_RESERVE
    holders = max(1, math.ceil(total / per_process))
    shares = [total // holders + (i < total % holders) for i in range(holders)]
    mp = multiprocessing.get_context("spawn")
    port = urlsplit(ctx.fleet.url).port
    gw = ctx.fleet.proc.pid
    procs, pipes, opened = [], [], []
    try:
        for share in shares:  # one after another: each paces itself on the gateway's files
            parent, child = mp.Pipe()
            args = ("127.0.0.1", port, share, gw, child)
            procs.append(mp.Process(target=hold_connections, args=args))
            procs[-1].start()
            pipes.append(parent)
            opened.append(await asyncio.to_thread(recv, parent, 180))
        t_held = time.monotonic()
        open_s = t_held - t0
        fds_at_hold = open_fds(gw)
        local = await local_victim(ctx, ctx.args.hold_s)
        await asyncio.sleep(max(0.0, t_held + ctx.args.hold_s - time.monotonic()))
        victim = probe_stats(
            await finished(overlapping(ctx.victim.chats, t_held, time.monotonic()))
        )
        fds_end = open_fds(gw)
        for pipe in pipes:
            pipe.send("close")
        fates = [await asyncio.to_thread(recv, p, 60) for p in pipes]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    held: Counter[str] = Counter()
    for fate in fates:
        held.update(fate)
    figures = {
        "requested": total,
        "opened": sum(o["opened"] for o in opened),
        "established": sum(o["established"] for o in opened),
        "open_s": round(open_s, 1),
        "gateway_fd_limit": fd_limit(gw),
        "gateway_open_fds": max(filter(None, (fds_at_hold, fds_end)), default=None),
        "victim_ok_while_held": f"{victim['ok']}/{victim['count']}",
        "local_victim_ok": f"{local['answers'].get('200', 0)}/{local['count']}",
        "held_still_silent_open": held.get("open_silent", 0),
    }
    return {
        "holder_processes": opened,
        "gateway_open_fds": {"at_hold": fds_at_hold, "at_end": fds_end},
        "victim_while_held": victim,
        "victim_from_attacker_address_while_held": local,
        "connections_at_end": dict(held),
        "figures": figures,
    }


def recv(pipe: Any, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise TimeoutError(f"no report from a connection holder in {timeout} s")
    return pipe.recv()


SMALL_BODIES: dict[str, tuple[bytes, dict[str, str]]] = {
    "lone_surrogate": (
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800"}],'
        b' "max_tokens": 4}',
        {},
    ),
    "nested_2000": (
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,'
        b' "x": ' + b"[" * 2000 + b"]" * 2000 + b"}",
        {},
    ),
    "invalid_gzip": (b"this is not gzip", {"Content-Encoding": "gzip"}),
    "role_list": (ROLE_LIST_BODY, {}),
}


async def small_bodies(ctx: Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {}
    figures: dict[str, Any] = {}
    for name, (body, headers) in SMALL_BODIES.items():
        for target, base in (("gateway", ctx.fleet.url), ("engine", ctx.fleet.engine_url)):
            answer = await http_request(base, "POST", CHAT, body, headers, timeout=30)
            out[f"{name}_{target}"] = answer.brief()
            figures[f"{name}_{target}"] = answer.text()
    return {**out, "figures": figures}


# In this order, on one fleet. An attack's harm can outlast it: at the baseline every ejection
# lengthens the next (base_s x count, forgotten after max_s), so 3, which measures ejection
# windows, goes first; later attacks then meet the longer ejections it leaves, as clients would.
ATTACKS: dict[str, Callable[[Ctx], Awaitable[dict]]] = {
    "3_ejection_rounds": ejection,
    "1a_deflate_bomb_gateway": encoded_body("deflate_bomb", "deflate", "gateway"),
    "1b_gzip_spaces_gateway": encoded_body("gzip_spaces", "gzip", "gateway"),
    "1c_deflate_bomb_engine": encoded_body("deflate_bomb", "deflate", "engine"),
    "1d_gzip_spaces_engine": encoded_body("gzip_spaces", "gzip", "engine"),
    "2_n10000_gateway": many_choices,
    "4a_4mb_chat_gateway": big_prompt("big_chat", CHAT, "gateway"),
    "4b_4mb_completion_gateway": big_prompt("big_completion", COMPLETIONS, "gateway"),
    "4c_4mb_chat_engine": big_prompt("big_chat", CHAT, "engine"),
    "4d_4mb_completion_engine": big_prompt("big_completion", COMPLETIONS, "engine"),
    "6_small_bodies": small_bodies,
    "5a_slow_clients": slow_clients,
    "5b_half_open_connections": half_open,
}


# ---- one run ----------------------------------------------------------------------------------


async def settle(ctx: Ctx) -> float:
    """Waits (bounded) until the gateway is ready again and refreshes the engine's address."""
    t0 = time.monotonic()
    while time.monotonic() < t0 + SETTLE_CAP_S:
        if (await http_request(ctx.fleet.url, "GET", "/ready", timeout=2)).status == 200:
            with contextlib.suppress(OSError, RuntimeError, ValueError, StopIteration):
                await asyncio.to_thread(ctx.fleet.refresh)
                break
        await asyncio.sleep(0.25)
    return round(time.monotonic() - t0, 2)


async def run_attack(ctx: Ctx, attack: Callable[[Ctx], Awaitable[dict]]) -> dict[str, Any]:
    settle_s = await settle(ctx)
    t0 = time.monotonic()
    try:
        detail = await asyncio.wait_for(attack(ctx), ATTACK_CAP_S)
    except Exception as exc:  # one attack's failure is its result, not the run's end
        detail = {"error": f"{type(exc).__name__}: {exc}"}
    t1 = time.monotonic()
    await asyncio.sleep(ctx.args.after_s)
    t2 = time.monotonic()
    victim = ctx.victim
    during = probe_stats(await finished(overlapping(victim.chats, t0, t1)))
    after = probe_stats(await finished([p for p in list(victim.chats) if t1 <= p.start < t2]))
    health = {  # during and right after: a stalled event loop may outlast the answer
        name: probe_stats(await finished(overlapping(probes, t0, t2)))
        for name, probes in victim.health.items()
    }
    rss = {role: ctx.sampler.figures(role, t0, t1) for role in ("gateway", "engine")}
    figures = {
        **detail.pop("figures", {}),
        "victim_ok": f"{during['ok']}/{during['count']}",
        "victim_p50_ms": during["p50_ms"],
        "victim_max_ms": during["max_ms"],
        "victim_ok_after": f"{after['ok']}/{after['count']}",
        "gateway_health_max_ms": health["gateway"]["max_ms"],
        "engine_health_max_ms": health["engine"]["max_ms"],
        "gateway_rss_peak_mb": rss["gateway"]["peak_mb"],
        "engine_rss_peak_mb": rss["engine"]["peak_mb"],
    }
    if "error" in detail:
        figures["error"] = detail["error"]
    return {
        "settle_s": settle_s,
        "seconds": round(t1 - t0, 2),
        "attack": detail,
        "victim_during": during,
        "victim_after": after,
        "health": health,
        "rss": rss,
        "figures": figures,
    }


async def run_attacks(ctx: Ctx, names: list[str]) -> dict[str, Any]:
    results = {}
    for name in names:
        print(f"  {name} ...", file=sys.stderr, flush=True)
        results[name] = await run_attack(ctx, ATTACKS[name])
        print(f"    {json.dumps(results[name]['figures'])}", file=sys.stderr, flush=True)
    return results


def run_suite(
    repo: Path, args: argparse.Namespace, payloads: dict[str, bytes], names: list[str]
) -> dict:
    """Starts the fleet from ``repo``, replays the attacks, stops it."""
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="modelyard-attacks-"))
    fleet = Fleet(repo, workdir, args.model)
    out: dict[str, Any] = {"repo": str(repo), **checkout_state(repo), "log": str(fleet.log)}
    victim = Victim(fleet, args.victim_concurrency, VICTIM_ADDRESS)
    sampler = RssSampler(fleet)
    try:
        out["imports"] = fleet.imports()
        print(f"{repo}: {out['imports']}", file=sys.stderr, flush=True)
        fleet.start(args.ready_timeout)
        out["engine_start_s"] = round(time.monotonic() - started, 1)
        sampler.start()
        victim.start()
        warm_deadline = time.monotonic() + 60
        while sum(p.ok for p in list(victim.chats)) < 3 and time.monotonic() < warm_deadline:
            time.sleep(0.2)
        ctx = Ctx(fleet, victim, sampler, args, payloads)
        out["attacks"] = asyncio.run(run_attacks(ctx, names))
    except Exception as exc:  # reported: the other checkout still runs
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["log_tail"] = (
            fleet.log.read_text(errors="replace")[-3000:] if fleet.log.exists() else ""
        )
        print(f"{repo}: {out['error']}", file=sys.stderr, flush=True)
    finally:
        victim.stop()
        sampler.stop()
        out["stop"] = fleet.stop()
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


# ---- report -----------------------------------------------------------------------------------


def ratio(key: str, baseline: Any, current: Any) -> float | None:
    numbers = all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in (baseline, current)
    )
    if not (key.endswith(RATIO_SUFFIXES) and numbers and current):
        return None
    return round(baseline / current, 2)


def side_by_side(baseline: dict, current: dict) -> dict[str, Any]:
    """Per attack and figure: baseline, current and baseline/current for times and sizes."""
    table: dict[str, Any] = {}
    b_attacks, c_attacks = baseline.get("attacks", {}), current.get("attacks", {})
    for name in dict.fromkeys([*b_attacks, *c_attacks]):
        b = b_attacks.get(name, {}).get("figures", {})
        c = c_attacks.get(name, {}).get("figures", {})
        table[name] = {
            key: {
                "baseline": b.get(key),
                "current": c.get(key),
                "ratio": ratio(key, b.get(key), c.get(key)),
            }
            for key in dict.fromkeys([*b, *c])
        }
    return table


def print_table(report: dict) -> None:
    if "side_by_side" in report:
        print(f"{'figure':<44} {'baseline':>24} {'current':>24} {'ratio':>7}", file=sys.stderr)
        for name, rows in report["side_by_side"].items():
            print(name, file=sys.stderr)
            for key, row in rows.items():
                r = "" if row["ratio"] is None else f"{row['ratio']:g}"
                print(
                    f"  {key:<42} {row['baseline']!s:>24} {row['current']!s:>24} {r:>7}",
                    file=sys.stderr,
                )
        return
    for name, result in report["result"].get("attacks", {}).items():
        print(name, file=sys.stderr)
        for key, value in result["figures"].items():
            print(f"  {key:<42} {value!s:>24}", file=sys.stderr)


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--repo", type=Path, default=REPO, help="checkout whose servers to attack (default: this)")
    add("--compare", type=Path, metavar="BASELINE", help="run this checkout first, side by side")
    add("--model", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    add("--only", default="", help="comma-separated attack ids, e.g. 1a,3,5b (default: all)")
    add("--connections", type=int, default=20300, help="silent connections of attack 5b")
    add("--hold-s", type=float, default=10.0, help="how long 5b holds them")
    add("--slow-cap-s", type=float, default=60.0, help="longest wait on one slow client")
    add("--give-up-s", type=float, default=10.0, help="attack 2's client timeout")
    add("--rounds", type=int, default=3, help="attack 3's rounds")
    add("--bodies-per-round", type=int, default=5)
    add("--after-s", type=float, default=3.0, help="victim window right after each attack")
    add("--victim-concurrency", type=int, default=3)
    add("--ready-timeout", type=float, default=300.0, help="gateway + engine start-up bound")
    add("--out", type=Path, help="write the JSON report here too")
    args = p.parse_args(argv)
    args.repo, args.model = args.repo.resolve(), args.model.resolve()
    if args.compare:
        args.compare = args.compare.resolve()
    return args


def selected(only: str) -> list[str]:
    ids = [i for i in only.split(",") if i]
    names = [n for n in ATTACKS if not ids or n.split("_", 1)[0] in ids or n[0] in ids]
    if not names:
        raise SystemExit(f"--only {only!r} matches none of {', '.join(ATTACKS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the servers are stopped
    names = selected(args.only)
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "denial-of-service attacks against modelyard serve, with a victim client",
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
            "nofile_limit": raise_nofile(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    print("building payloads ...", file=sys.stderr, flush=True)
    payloads = build_payloads()
    if args.compare:
        report["baseline"] = run_suite(args.compare, args, payloads, names)
        report["current"] = run_suite(args.repo, args, payloads, names)
        report["side_by_side"] = side_by_side(report["baseline"], report["current"])
    else:
        report["result"] = run_suite(args.repo, args, payloads, names)
    report["machine"]["load_average_at_end"] = os.getloadavg()
    report["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    print_table(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
