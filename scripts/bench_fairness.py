#!/usr/bin/env python
"""Fairness benchmark: tenants (API keys) of different weights and request lengths compete for one
model's slots through the gateway, under ``fair`` (fair queuing by tokens) and ``fcfs`` in the same
run, on real engines. JSON out (stdout, and --out).

One gateway (``modelyard serve``) spawns two engines of a tiny random Llama (scripts/
tiny_models.py): models ``fair`` and ``fcfs``, each with --slots slots (``admission.
max_in_flight``), differing only in ``admission.policy``. Three tenants run closed loops of
streamed completions (a prompt of three token ids, ``max_tokens`` generated with ``ignore_eos``):
``long`` (weight 1, 96 tokens, 8 clients) floods, ``short`` (weight 1, 8 tokens, 6 clients) asks
little at a time, ``heavy`` (weight 2, 32 tokens, 6 clients) has twice the share. Each policy gets
--seconds of load after --warmup seconds, one after the other. From the gateway's access log (a
request's generated tokens spread from its admission to its end): each tenant's generated tokens/s
per second of the window, its share of the generated tokens and of the service (prompt and
generated tokens, what fair queuing shares by weight) beside its weight's share, and its queue
wait (p50, p99); then the ratios: each policy's service shares over the weights' (1 when served
by weight), and each tenant's p99 wait under fcfs over fair's. Every loop is bounded by the
window; the gateway and its engines are stopped at the end.

    python scripts/bench_fairness.py --out bench-results/fairness.json
    python scripts/bench_fairness.py --seconds 20 --slots 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script: make `scripts` and `common` importable

from common.net import free_port  # noqa: E402
from common.processes import stop_process  # noqa: E402
from scripts.bench_residency import run_record  # noqa: E402
from scripts.measure import percentile, write_report  # noqa: E402
from scripts.serving.engine_server import wait_ready  # noqa: E402
from scripts.tiny_models import build_tiny_llama, tiny_engine_entry  # noqa: E402

PROMPT = [5, 6, 7]
POLICIES = ("fair", "fcfs")
# name: (weight, max_tokens, clients)
TENANTS = {"long": (1.0, 96, 8), "short": (1.0, 8, 6), "heavy": (2.0, 32, 6)}
START_TIMEOUT_S = 120.0


def models_yaml(source: Path, slots: int) -> dict[str, Any]:
    engine = tiny_engine_entry(source, max_num_seqs=max(4, slots))
    keys = [
        {"name": name, "key_env": _env(name), "weight": weight}
        for name, (weight, _, _) in TENANTS.items()
    ]
    return {
        "gateway": {"watch_config": False, "auth": {"keys": keys}},
        "models": [
            {"name": policy, **engine, "admission": {"max_in_flight": slots, "policy": policy}}
            for policy in POLICIES
        ],
    }


def _env(tenant: str) -> str:
    return f"BENCH_FAIRNESS_{tenant.upper()}"


def _secret(tenant: str) -> str:
    return f"sk-bench-{tenant}"


async def _stream(session: aiohttp.ClientSession, url: str, tenant: str, model: str) -> int:
    _, max_tokens, _ = TENANTS[tenant]
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {_secret(tenant)}"}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        await resp.read()  # unparsed: the client must not be what keeps a tenant idle
        return resp.status


async def _ready(url: str, deadline: float) -> None:
    """Until every model answers (its engine is up)."""
    async with aiohttp.ClientSession() as session:
        for model in POLICIES:
            while await _stream(session, url, "short", model) != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"model {model} not answering")
                await asyncio.sleep(0.2)


async def _load(url: str, model: str, until: float) -> dict[str, int]:
    """Every tenant's clients in closed loops until ``until`` (wall clock); statuses counted."""
    statuses: dict[str, int] = {}

    async def client(session: aiohttp.ClientSession, tenant: str) -> None:
        while time.time() < until:
            status = await _stream(session, url, tenant, model)
            statuses[str(status)] = statuses.get(str(status), 0) + 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(
            *(client(session, tenant) for tenant, (_, _, n) in TENANTS.items() for _ in range(n))
        )
    return statuses


def _entries(access_log: Path, model: str) -> list[dict[str, Any]]:
    lines = access_log.read_text().splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in entries if e.get("model") == model and e.get("status") == 200]


def _per_second(entries: list[dict[str, Any]], t1: float, seconds: int) -> list[float]:
    """Generated tokens in each second from ``t1``, each request's spread evenly from its
    admission (its end less the time it held its slot) to its end."""
    buckets = [0.0] * seconds
    for e in entries:
        end = e["ts"]
        admitted = end - (e["latency_ms"] - e["queue_wait_ms"]) / 1000
        span = max(end - admitted, 1e-6)
        for i in range(seconds):
            lo, hi = t1 + i, t1 + i + 1
            overlap = max(0.0, min(end, hi) - max(admitted, lo))
            buckets[i] += e["completion_tokens"] * overlap / span
    return [round(b, 1) for b in buckets]


def _prompts(entries: list[dict[str, Any]], t1: float, t2: float) -> int:
    """Prompt tokens of the requests admitted within [t1, t2)."""
    return sum(
        e["prompt_tokens"]
        for e in entries
        if t1 <= e["ts"] - (e["latency_ms"] - e["queue_wait_ms"]) / 1000 < t2
    )


def summarize(entries: list[dict[str, Any]], t1: float, seconds: int) -> dict[str, Any]:
    """Per tenant: generated tokens/s per second of the window, its generated tokens and its
    service (prompt + generated tokens: what fair queuing shares by weight), their shares, and
    its queue waits."""
    total_weight = sum(weight for weight, _, _ in TENANTS.values())
    tenants: dict[str, Any] = {}
    for tenant, (weight, max_tokens, clients) in TENANTS.items():
        mine = [e for e in entries if e["key"] == tenant]
        series = _per_second(mine, t1, seconds)
        waits = [e["queue_wait_ms"] for e in mine if t1 <= e["ts"] - e["latency_ms"] / 1000]
        tenants[tenant] = {
            "weight": weight,
            "max_tokens": max_tokens,
            "clients": clients,
            "requests": len(waits),
            "tokens_per_s": series,
            "generated_tokens": round(sum(series)),
            "service_tokens": round(sum(series)) + _prompts(mine, t1, t1 + seconds),
            "weight_share": round(weight / total_weight, 3),
            "queue_wait_p50_ms": _round(percentile(waits, 50)),
            "queue_wait_p99_ms": _round(percentile(waits, 99)),
        }
    generated = sum(t["generated_tokens"] for t in tenants.values()) or 1
    service = sum(t["service_tokens"] for t in tenants.values()) or 1
    for t in tenants.values():
        t["token_share"] = round(t["generated_tokens"] / generated, 3)
        t["service_share"] = round(t["service_tokens"] / service, 3)
    return {"generated_tokens_per_s": round(generated / seconds, 1), "tenants": tenants}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Each policy's service share over the weight's (1.0: served by weight; a tenant that asks
    for less than its share gets less, and waits little), and each tenant's p99 wait under fcfs
    over fair's (below 1 for the tenant that floods: fair makes it wait its turn)."""
    fair, fcfs = results["fair"]["tenants"], results["fcfs"]["tenants"]

    def over(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a is not None and b else None

    return {
        tenant: {
            "fair_share_over_weight": over(fair[tenant]["service_share"], t["weight_share"]),
            "fcfs_share_over_weight": over(fcfs[tenant]["service_share"], t["weight_share"]),
            "p99_wait_fcfs_over_fair": over(
                fcfs[tenant]["queue_wait_p99_ms"], fair[tenant]["queue_wait_p99_ms"]
            ),
        }
        for tenant, t in fair.items()
    }


async def run(args: argparse.Namespace, work: Path, report: dict[str, Any]) -> None:
    source = build_tiny_llama(work / "tiny-llama")
    config = work / "models.yaml"
    config.write_text(yaml.safe_dump(models_yaml(source, args.slots), sort_keys=False))
    access_log = work / "access.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config), "--port",
               str(port), "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, **{_env(tenant): _secret(tenant) for tenant in TENANTS}}
    with access_log.open("wb") as stdout, (work / "gateway.log").open("wb") as stderr:
        gateway = subprocess.Popen(command, cwd=REPO, stdout=stdout, stderr=stderr, env=env)
    try:
        await asyncio.to_thread(wait_ready, gateway, url + "/ready", "gateway", START_TIMEOUT_S)
        await _ready(url, time.monotonic() + START_TIMEOUT_S)
        results: dict[str, Any] = {}
        for policy in POLICIES:
            start = time.time()
            t1 = start + args.warmup
            statuses = await _load(url, policy, t1 + args.seconds)
            await asyncio.sleep(0.3)  # the access log is flushed every 0.1 s
            results[policy] = {
                "statuses": statuses,
                **summarize(_entries(access_log, policy), t1, math.floor(args.seconds)),
            }
        report["results"] = results
        report["ratios"] = ratios(results)
    finally:
        stop_process(gateway, 60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="measured, per policy")
    parser.add_argument("--warmup", type=float, default=2.0, help="before the window, per policy")
    parser.add_argument("--slots", type=int, default=2, help="admission.max_in_flight")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.seconds < 1 or args.warmup < 0 or args.slots < 1:
        parser.error("--seconds >= 1, --warmup >= 0, --slots >= 1")
    report: dict[str, Any] = {
        "benchmark": "fairness: tenants of different weights and lengths, fair vs fcfs",
        **run_record(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "tenants": {
            t: dict(zip(("weight", "max_tokens", "clients"), v, strict=True))
            for t, v in TENANTS.items()
        },
    }
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        asyncio.run(run(args, Path(tmp), report))
    report["machine"]["load_average_at_end"] = os.getloadavg()
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
