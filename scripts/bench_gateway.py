#!/usr/bin/env python
"""Gateway overhead benchmark: the same load direct to an upstream and through the gateway, side
by side in one run, JSON out.

Upstreams: a fast mock OpenAI server (scripts/mock_upstream.py, started here) and, with
``--engine-url``, a real engine (or any OpenAI-compatible server) already running.

For each upstream: non-streaming requests at concurrency 1 (latency p50/p99) and 64 (requests/s),
streaming time to first chunk at concurrency 1, and the gateway process's CPU seconds per 1,000
proxied requests (from /proc/PID/stat). Then the rate limits' cost: CPU per request at
concurrency 64 through two more gateways whose model has rpm/tpm limits, kept in-process and in
a redis-server on loopback (``gateway.state``), in alternating rounds. Every phase is bounded by a
request count and a time limit.

Admission (the mock only): the same concurrency-64 load on two models of the one mock, in the same
gateway process: ``bench``, whose slots (256 per backend, an external upstream's default) are never
all taken, so every request passes its model's line at once (the path requests took before
admission had a line), and ``bench-admitted``, with ADMITTED_SLOTS slots, so that most requests
wait in the line and are dispatched by the fair scheduler; the gateway's CPU per request of each,
and their ratio (goal: at most 1.3).

    python scripts/bench_gateway.py --out bench-results/gateway.json
    python scripts/bench_gateway.py --engine-url http://127.0.0.1:8001 --engine-model smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from common.net import free_port

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script: make `scripts` importable

from common.processes import cpu_seconds, stop_process  # noqa: E402
from scripts.bench_residency import machine  # noqa: E402
from scripts.measure import percentile  # noqa: E402
from scripts.mock_upstream import MockUpstream  # noqa: E402
from scripts.redis_server import RedisServer  # noqa: E402

IDLE_SAMPLE_S = 2.0
ADMITTED_SLOTS = 8  # bench-admitted's: at concurrency 64, 56 requests wait in its line
GOALS = {
    "cpu_ms_per_request": 0.5,
    "added_p50_ms_c1": 1.0,
    "gateway_rps_c64": 1500,
    "first_chunk_overhead_ms": 1.0,
    "limits_redis_cpu_ratio": 1.3,  # CPU per request, limits in Redis vs in-process
    "admission_cpu_ratio": 1.3,
}
UNLIMITED = {"rpm": 10**9, "tpm": 10**12}  # limits that never refuse: their cost alone


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=1).read()
            return
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout}s")


async def raw_load(
    url: str, body: bytes, concurrency: int, count: int, max_s: float
) -> dict[str, Any]:
    """Non-streaming load from a lean keep-alive HTTP/1.1 client (asyncio streams), so that the
    load generator takes less of the shared CPUs than an aiohttp client would."""
    parts = urlsplit(url)
    request = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    latencies: list[float] = []
    errors = 0
    issued = 0
    start = time.perf_counter()
    deadline = start + max_s

    async def worker() -> None:
        nonlocal issued, errors
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            while issued < count and time.perf_counter() < deadline:
                issued += 1
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                await reader.readexactly(length)
                if head.startswith(b"HTTP/1.1 200"):
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return _summary(latencies, [], errors, elapsed)


def _summary(
    latencies: list[float], first_chunks: list[float], errors: int, elapsed: float
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "requests": len(latencies),
        "errors": errors,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(latencies) / elapsed, 1),
    }
    if latencies:
        result.update(
            p50_ms=round(percentile(latencies, 50) * 1000, 3),
            p99_ms=round(percentile(latencies, 99) * 1000, 3),
            mean_ms=round(statistics.fmean(latencies) * 1000, 3),
        )
    if first_chunks:
        result.update(
            first_chunk_p50_ms=round(percentile(first_chunks, 50) * 1000, 3),
            first_chunk_p99_ms=round(percentile(first_chunks, 99) * 1000, 3),
        )
    return result


async def load(
    url: str, body: bytes, concurrency: int, count: int, max_s: float, stream: bool = False
) -> dict[str, Any]:
    """Sends up to ``count`` requests from ``concurrency`` workers for at most ``max_s``."""
    latencies: list[float] = []
    first_chunks: list[float] = []
    errors = 0
    issued = 0
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        deadline = start + max_s

        async def worker() -> None:
            nonlocal issued, errors
            while issued < count and time.perf_counter() < deadline:
                issued += 1
                t0 = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        if stream:
                            await resp.content.readany()
                            first_chunks.append(time.perf_counter() - t0)
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return _summary(latencies, first_chunks, errors, elapsed)


async def measure(
    direct_base: str,
    gateway_base: str,
    gateway_pid: int,
    direct_model: str,
    gateway_model: str,
    args: argparse.Namespace,
    scale: float,
) -> dict[str, Any]:
    def body(model: str, stream: bool) -> bytes:
        return json.dumps(
            {
                "model": model,
                "max_tokens": args.max_tokens,
                "stream": stream,
                "messages": [{"role": "user", "content": "Say hi."}],
            }
        ).encode()

    def n(count: int) -> int:
        return max(10, int(count * scale))

    def gateway_cpu_s() -> float:
        return _cpu_s(gateway_pid)

    out: dict[str, Any] = {"direct": {}, "gateway": {}}
    targets = (("direct", direct_base, direct_model), ("gateway", gateway_base, gateway_model))
    path = "/v1/chat/completions"
    for _name, base, model in targets:  # warm connections and caches
        await load(base + path, body(model, False), 8, n(200), 10)
    # Background CPU (health checks, timers) while idle, to subtract from slow phases.
    idle_before = gateway_cpu_s()
    await asyncio.sleep(IDLE_SAMPLE_S)
    idle_rate = (gateway_cpu_s() - idle_before) / IDLE_SAMPLE_S
    out["gateway_idle_cpu_s_per_s"] = round(idle_rate, 5)
    phases = (
        ("c1", 1, n(args.requests_c1), False),
        ("c64", 64, n(args.requests_c64), False),
        ("stream_c1", 1, n(args.requests_stream), True),
    )
    for phase, concurrency, count, stream in phases:
        for name, base, model in targets:
            cpu_before = gateway_cpu_s()
            if stream:
                result = await load(
                    base + path, body(model, True), concurrency, count, args.max_seconds, True
                )
            else:
                result = await raw_load(
                    base + path, body(model, False), concurrency, count, args.max_seconds
                )
            if name == "gateway" and result["requests"]:
                cpu = gateway_cpu_s() - cpu_before
                net = max(0.0, cpu - idle_rate * result["seconds"])
                result["gateway_cpu_s_per_1000"] = round(cpu / result["requests"] * 1000, 4)
                result["gateway_cpu_s_per_1000_net_of_idle"] = round(
                    net / result["requests"] * 1000, 4
                )
            out[name][phase] = result
    d, g = out["direct"], out["gateway"]
    out["gateway_vs_direct"] = {
        "added_p50_ms_c1": round(g["c1"]["p50_ms"] - d["c1"]["p50_ms"], 3),
        "added_p99_ms_c1": round(g["c1"]["p99_ms"] - d["c1"]["p99_ms"], 3),
        "added_p50_ms_c64": round(g["c64"]["p50_ms"] - d["c64"]["p50_ms"], 3),
        "added_p99_ms_c64": round(g["c64"]["p99_ms"] - d["c64"]["p99_ms"], 3),
        "requests_per_s_ratio_c64": round(
            g["c64"]["requests_per_s"] / d["c64"]["requests_per_s"], 3
        ),
        "first_chunk_overhead_p50_ms": round(
            g["stream_c1"]["first_chunk_p50_ms"] - d["stream_c1"]["first_chunk_p50_ms"], 3
        ),
        "gateway_cpu_ms_per_request_c64": g["c64"].get("gateway_cpu_s_per_1000"),
        "gateway_cpu_ms_per_request_c1": g["c1"].get("gateway_cpu_s_per_1000"),
        "gateway_cpu_ms_per_request_c64_net_of_idle": g["c64"].get(
            "gateway_cpu_s_per_1000_net_of_idle"
        ),
    }
    return out


def _cpu_s(pid: int) -> float:
    seconds = cpu_seconds(pid)
    if seconds is None:
        raise RuntimeError(f"the gateway (PID {pid}) is gone")
    return seconds


async def measure_admission(
    gateway_base: str, gateway_pid: int, args: argparse.Namespace, idle_rate: float
) -> dict[str, Any]:
    """Concurrency 64 on ``bench`` (every request passes its line at once) and on
    ``bench-admitted`` (most wait in it): the gateway's CPU per request of each, in turns."""
    body = json.dumps(
        {"model": "bench", "max_tokens": args.max_tokens,
         "messages": [{"role": "user", "content": "Say hi."}]}
    ).encode()  # fmt: skip
    bodies = {"passthrough": body, "queued": body.replace(b'"bench"', b'"bench-admitted"')}
    url = gateway_base + "/v1/chat/completions"
    out: dict[str, Any] = {"slots_queued": ADMITTED_SLOTS}
    for request in bodies.values():
        await raw_load(url, request, 8, 200, 10)  # warm
    for name, request in bodies.items():
        cpu_before = _cpu_s(gateway_pid)
        result = await raw_load(url, request, 64, args.requests_c64, args.max_seconds)
        cpu = _cpu_s(gateway_pid) - cpu_before
        if result["requests"]:
            net = max(0.0, cpu - idle_rate * result["seconds"])
            result["gateway_cpu_ms_per_request"] = round(cpu / result["requests"] * 1000, 4)
            result["gateway_cpu_ms_per_request_net_of_idle"] = round(
                net / result["requests"] * 1000, 4
            )
        out[name] = result
    passthrough = out["passthrough"].get("gateway_cpu_ms_per_request")
    queued = out["queued"].get("gateway_cpu_ms_per_request")
    out["cpu_ratio_queued_over_passthrough"] = (
        round(queued / passthrough, 3) if passthrough and queued else None
    )
    return out


def write_config(
    path: Path,
    models: list[dict[str, Any]],
    access_log: bool,
    state: dict[str, Any] | None = None,
) -> None:
    import yaml

    gateway: dict[str, Any] = {
        "access_log": access_log,
        "watch_config": False,
        "health": {"interval_s": 5, "timeout_s": 2},
    }
    if state:
        gateway["state"] = state
    path.write_text(yaml.safe_dump({"gateway": gateway, "models": models}))


def start_gateway(config: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config), "--port", str(port),
         "--log-level", "warning"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/ready", gateway)
    except RuntimeError:
        stop_process(gateway, 10)
        raise
    return gateway, url


async def measure_limits(mock_url: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The gateway's CPU per request (c64) with its model's rpm/tpm limits kept in-process and
    in Redis on loopback, alternating rounds of each; and redis-server's own CPU beside it."""
    if shutil.which("redis-server") is None:
        return {"skipped": "redis-server not found (make bench installs it)"}
    (tmp / "redis").mkdir()
    redis = RedisServer(tmp / "redis")
    gateways: dict[str, tuple[subprocess.Popen, str]] = {}
    models = [{"name": "bench", "upstreams": [mock_url], "limits": UNLIMITED}]
    body = json.dumps(
        {"model": "bench", "max_tokens": args.max_tokens, "messages": [{"role": "user",
         "content": "Say hi."}]}
    ).encode()  # fmt: skip
    path = "/v1/chat/completions"
    try:
        redis.start()
        assert redis.proc is not None
        states = {"in_process": None, "redis": {"redis_url": redis.url, "gateways": 1}}
        for name, state in states.items():
            config = tmp / f"limits-{name}.yaml"
            write_config(config, models, not args.no_access_log, state)
            gateways[name] = start_gateway(config)
        for _proc, url in gateways.values():  # warm connections and caches
            await load(url + path, body, 8, 200, 10)
        spent = {name: [0.0, 0] for name in gateways}  # gateway CPU s, requests
        redis_cpu = 0.0
        rounds: list[dict[str, float]] = []
        for i in range(args.limits_rounds):
            figures: dict[str, float] = {}
            # Each path goes first every other round: the machine's other load drifts.
            for name, (proc, url) in sorted(gateways.items(), reverse=i % 2 == 1):
                before = (cpu_seconds(proc.pid) or 0.0, cpu_seconds(redis.proc.pid) or 0.0)
                result = await raw_load(
                    url + path, body, 64, args.limits_requests, args.max_seconds
                )
                if not result["requests"]:
                    raise RuntimeError(f"limits {name}: no request answered 200 ({result})")
                cpu = (cpu_seconds(proc.pid) or 0.0) - before[0]
                spent[name][0] += cpu
                spent[name][1] += result["requests"]
                figures[name] = round(cpu / result["requests"] * 1000, 4)
                if name == "redis":
                    redis_cpu += (cpu_seconds(redis.proc.pid) or 0.0) - before[1]
            figures["ratio"] = round(figures["redis"] / figures["in_process"], 3)
            rounds.append(figures)
    finally:
        for proc, _url in gateways.values():
            stop_process(proc, 10)
        redis.stop()
    out: dict[str, Any] = {
        name: {"requests": count, "gateway_cpu_ms_per_request": round(cpu / count * 1000, 4)}
        for name, (cpu, count) in spent.items()
    }
    out["redis"]["redis_server_cpu_ms_per_request"] = round(redis_cpu / spent["redis"][1] * 1000, 4)
    out["rounds_gateway_cpu_ms_per_request"] = rounds
    # The median round's: a round that other load on the machine inflated does not decide it.
    out["gateway_cpu_ratio_redis_vs_in_process"] = statistics.median(r["ratio"] for r in rounds)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    mock = MockUpstream("mock")
    gateway: subprocess.Popen | None = None
    report: dict[str, Any] = {
        "benchmark": "gateway overhead (direct vs through the gateway)",
        "machine": machine(),  # the CPU model too: figures only compare on the same one
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "goals": GOALS,
    }
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mock_url = mock.start(timeout=60).url
            models = [
                {"name": "bench", "upstreams": [mock_url]},
                {
                    "name": "bench-admitted",
                    "upstreams": [mock_url],
                    "admission": {"max_in_flight": ADMITTED_SLOTS},
                },
            ]
            if args.engine_url:
                models.append(
                    {
                        "name": "engine",
                        "upstreams": [args.engine_url],
                        "upstream_model": args.engine_model,
                        "health_path": args.engine_health_path,
                    }
                )
            config = Path(tmp) / "models.yaml"
            write_config(config, models, not args.no_access_log)
            gateway, gateway_url = start_gateway(config)
            report["mock"] = await measure(
                mock_url, gateway_url, gateway.pid, "mock", "bench", args, 1.0
            )
            report["admission"] = await measure_admission(
                gateway_url, gateway.pid, args, report["mock"]["gateway_idle_cpu_s_per_s"]
            )
            if args.engine_url:
                wait_ready(args.engine_url.rstrip("/") + args.engine_health_path, None)
                report["engine"] = await measure(
                    args.engine_url.rstrip("/"),
                    gateway_url,
                    gateway.pid,
                    args.engine_model,
                    "engine",
                    args,
                    args.engine_scale,
                )
            report["limits"] = await measure_limits(mock_url, Path(tmp), args)
        finally:
            if gateway is not None:
                stop_process(gateway, 10)
            mock.stop()
    report["machine"]["load_average_at_end"] = os.getloadavg()
    vs = report["mock"]["gateway_vs_direct"]
    gateway_rps = report["mock"]["gateway"]["c64"]["requests_per_s"]
    cpu_ms = vs["gateway_cpu_ms_per_request_c64"]
    limits_ratio = report["limits"].get("gateway_cpu_ratio_redis_vs_in_process")
    admission_ratio = report["admission"]["cpu_ratio_queued_over_passthrough"]
    report["summary"] = {
        "gateway_cpu_ms_per_request": cpu_ms,
        "gateway_capacity_req_per_s_per_core": round(1000 / cpu_ms) if cpu_ms else None,
        "gateway_rps_c64_measured": gateway_rps,
        "added_p50_ms_c1": vs["added_p50_ms_c1"],
        "added_p99_ms_c1": vs["added_p99_ms_c1"],
        "first_chunk_overhead_ms": vs["first_chunk_overhead_p50_ms"],
        "limits_redis_cpu_ratio": limits_ratio,
        "admission_cpu_ratio_queued_over_passthrough": admission_ratio,
        "goals_met": {
            "cpu_ms_per_request": cpu_ms is not None and cpu_ms <= GOALS["cpu_ms_per_request"],
            "added_p50_ms_c1": vs["added_p50_ms_c1"] <= GOALS["added_p50_ms_c1"],
            "gateway_rps_c64": gateway_rps >= GOALS["gateway_rps_c64"],
            "first_chunk_overhead_ms": vs["first_chunk_overhead_p50_ms"]
            <= GOALS["first_chunk_overhead_ms"],
            "limits_redis_cpu_ratio": limits_ratio is not None
            and limits_ratio <= GOALS["limits_redis_cpu_ratio"],
            "admission_cpu_ratio": admission_ratio is not None
            and admission_ratio <= GOALS["admission_cpu_ratio"],
        },
        "note": "load generator, mock upstream and gateway share this machine's CPUs; "
        "requests/s is bounded by all three, CPU per request by the gateway alone",
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-c1", type=int, default=1000)
    parser.add_argument("--requests-c64", type=int, default=10000)
    parser.add_argument("--requests-stream", type=int, default=500)
    parser.add_argument("--max-seconds", type=float, default=20.0, help="per phase and target")
    parser.add_argument("--limits-requests", type=int, default=3000, help="per round and path")
    parser.add_argument("--limits-rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--no-access-log", action="store_true")
    parser.add_argument("--engine-url", help="also measure against this running server")
    parser.add_argument("--engine-model", default="smollm2")
    parser.add_argument("--engine-health-path", default="/ready")
    parser.add_argument(
        "--engine-scale",
        type=float,
        default=0.05,
        help="request counts for the engine, as a share of the mock's",
    )
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    try:
        import uvloop

        report = uvloop.run(main_async(args))
    except ImportError:
        report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
