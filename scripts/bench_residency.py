#!/usr/bin/env python
"""Residency benchmark: three models, a memory budget that holds two, one seeded stream of requests
whose popularity shifts over time, replayed under three policies in one run, each on a fresh
gateway process with real engines: all resident (budget lifted, the upper bound), cold swapping
(``park: false``: every eviction stops an engine, as llama-swap does) and park/wake (``park:
true``). JSON out (--out), a human summary on stdout.

Models: models/SmolLM2-135M-Instruct.Q4_1.gguf under two names (two engines of one file) and the
Gemma 3 270M GGUF when models/ has it (else a third SmolLM2 name; the JSON says which). Every model
is on demand with an idle TTL no run reaches, so only the budget evicts. The budget comes from the
first policy's measured footprints: the two largest awake, plus the smallest parked floor, plus a
margin (summary.choose_budget). Requests are streamed (TTFT), temperature 0, from ``--clients``
clients pulling from the one stream. At the end of the park/wake run each model's warm, wake and
cold time to first token is measured on its own. Every stream is bounded by --count and
--max-seconds; the default run takes about 10 minutes on 2 cores.

    python scripts/bench_residency.py --out bench-results/residency.json
    python scripts/bench_residency.py --count 30 --rotate-every 10 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script: make `scripts` and `common` importable

from common.sizes import parse_size  # noqa: E402
from scripts.residency_bench.policies import (  # noqa: E402
    Settings,
    run_all_resident,
    run_swapping,
)
from scripts.residency_bench.stream import build_stream, ranking, zipf_weights  # noqa: E402
from scripts.residency_bench.summary import (  # noqa: E402
    GOALS,
    anomalies,
    choose_budget,
    ratios,
)

log = logging.getLogger("bench_residency")
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_GLOB = "gemma-3-270m*.gguf"
MiB = 2**20


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # the first processor's fields ("model name\t: ...")
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    info["cpu_model"] = fields.get("model name") or None
    info["cpu_flags"] = {f: f in flags for f in ("avx2", "avx512f", "amx_tile")}
    with open("/proc/meminfo") as meminfo:
        info["mem_total_bytes"] = int(meminfo.readline().split()[1]) * 1024
    return info


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        result = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return result.stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


def run_record() -> dict[str, Any]:
    """Where and how a benchmark ran, for the head of its JSON: when, its command line, the
    commit (and whether the tree had changes) and the machine."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "git": git_commit(),
        "machine": machine(),
    }


def engine_has_sleep() -> bool:
    """Whether the engine's HTTP API has /sleep and /wake_up (else a park is refused and the
    park/wake policy degrades to cold swaps)."""
    return any("wake_up" in p.read_text() for p in (REPO / "engine" / "serving").glob("*.py"))


def pick_models(gemma: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Two SmolLM2 engines and Gemma 3 270M, or three SmolLM2 engines without it."""
    models = [
        {"name": "smollm2-a", "source": str(SMOLLM2)},
        {"name": "smollm2-b", "source": str(SMOLLM2)},
    ]
    found = Path(gemma) if gemma else next(iter(sorted((REPO / "models").glob(GEMMA_GLOB))), None)
    if found is not None and found.is_file():
        models.append({"name": "gemma3", "source": str(found)})
        note = {"gemma": str(found), "fallback": None}
    else:
        models.append({"name": "smollm2-c", "source": str(SMOLLM2)})
        note = {"gemma": None, "fallback": "no Gemma 3 GGUF in models/: a third SmolLM2 name"}
    return models, note


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def _row(cells: list[object], widths: list[int]) -> str:
    first, *rest = (str(c) for c in cells)
    return first.ljust(widths[0]) + "".join(
        c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)
    )


def print_summary(report: dict[str, Any]) -> None:
    settings = report["settings"]
    models = ", ".join(report["models"])
    print(f"\nresidency: {settings['count']} requests, {settings['clients']} clients, {models}")
    budget = report.get("budget") or {}
    if budget:
        total, two, floor = (
            budget[k] / MiB for k in ("cpu_bytes", "two_largest_awake_bytes", "parked_floor_bytes")
        )
        line = f"budget {total:.0f} MiB = two largest awake {two:.0f} MiB + parked floor "
        line += f"{floor:.0f} MiB ({budget['parked_floor_source']}) + growth reserved once "
        line += f"{budget.get('growth_bytes', 0) / MiB:.0f} MiB + margin"
        print(line + (f"; {budget['adjusted']}" if budget["adjusted"] else ""))
    widths = [14, 8, 9, 9, 10, 8, 16, 6, 6, 7, 10]
    header = ["policy", "req/s", "p50", "p99", "ttft p99", "errors", "evictions", "cold", "wake"]
    header += ["awake", "over bud."]
    print(_row(header, widths))
    for name, run in report["policies"].items():
        if "summary" not in run:
            print(f"{name:<14} failed: {run.get('error')}")
            continue
        s, w = run["summary"], run["swaps"]
        evictions = ",".join(f"{k}:{v}" for k, v in w["evictions_by_action"].items()) or "0"
        loads = w["loads_by_kind"]
        cells = [name, f"{s['requests_per_s']:.2f}", _fmt(s["latency_s"]["p50"])]
        cells += [_fmt(s["latency_s"]["p99"]), _fmt(s["ttft_s"]["p99"]), s["errors"], evictions]
        mem = run["memory_during_stream"]
        cells += [loads.get("cold", 0), loads.get("wake", 0), mem["max_models_awake"]]
        print(_row([*cells, f"{mem['samples_over_budget']}/{mem['samples']}"], widths))
    timings = report["policies"].get("park_wake", {}).get("timings", {})
    if timings:
        widths = [14, 9, 9, 9, 11, 11]
        print("\n" + _row(["TTFT", "warm", "wake", "cold", "wake load", "cold load"], widths))
        for model, t in timings.items():
            cells = [model, _fmt(t["warm"]["ttft_s"]), _fmt(t["wake"]["ttft_s"])]
            cells += [_fmt(t["cold"]["ttft_s"]), _fmt(t["wake"]["gateway_load_s"])]
            print(_row([*cells, _fmt(t["cold"]["gateway_load_s"])], widths))
    r = report.get("ratios") or {}
    if r:
        print("\nratios:")
        for key, value in r.items():
            if key != "goals_met":
                print(f"  {key}: {value}")
        print(f"  goals met: {json.dumps(r['goals_met'])}")
    held = report.get("budget_held") or {}
    if not all(held.values()):
        line = f"budget held during the streams: {held}"
        print(line + " (where False, the figures are not those of a budget of two)")
    left = report.get("engines_left_running")
    print(f"engines left running after the gateways stopped: {left or 'none'}")
    for note in report.get("anomalies") or []:
        print(f"odd: {note}")
    print(f"\nwall time {report['wall_s']:.0f} s; JSON: {settings['out']}")


async def main_async(args: argparse.Namespace, report: dict[str, Any]) -> None:
    models, note = pick_models(args.gemma)
    names = [m["name"] for m in models]
    report["models"] = names
    report["model_sources"] = {m["name"]: m["source"] for m in models}
    report["model_note"] = note
    stream = build_stream(names, args.count, args.seed, args.skew, args.rotate_every)
    report["stream"] = {
        "weights_by_rank": [round(w, 4) for w in zipf_weights(len(names), args.skew)],
        "rankings": [ranking(names, p) for p in range(len(names))],
        "requests_per_model": {n: sum(r.model == n for r in stream) for n in names},
        "models": [r.model for r in stream],
    }
    engine = {
        "kv_cache_memory": "256MiB",
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "idle_ttl_s": 86400,
        "queue": {"max_requests": 64, "max_wait_s": args.hold_wait_s},
    }
    report["engine_settings"] = engine
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-residency-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report["log_dir"] = str(log_dir)
    s = Settings(models, engine, stream, args.clients, args.max_tokens, args.max_seconds, log_dir)
    policies: dict[str, Any] = {}
    report["policies"] = policies

    log.info("policy 1/3: all resident")
    first = await run_all_resident(s, parse_size(args.resident_budget))
    policies["all_resident"] = first
    if "error" in first:
        raise RuntimeError(f"all_resident failed, no footprints for a budget: {first['error']}")
    fp = first["footprints"]
    budget = choose_budget(
        fp["awake_after_load"],
        fp["awake_after_wake"],
        fp["parked"],
        args.margin,
        growth=max(fp["growth"].values(), default=0),
    )
    if args.budget:
        budget.update(cpu_bytes=parse_size(args.budget), adjusted=f"--budget {args.budget}")
    report["budget"] = budget
    if fp["park_refused"]:
        refused = fp["park_refused"]
        report["degraded"] = f"engines would not park ({refused}): park/wake cannot park"
    estimates = fp["awake_after_load"]  # memory_estimate: plan with the measured figures at once
    for index, (name, park) in enumerate((("cold_swap", False), ("park_wake", True)), start=2):
        log.info("policy %d/3: %s (budget %.0f MiB)", index, name, budget["cpu_bytes"] / MiB)
        policies[name] = await run_swapping(s, name, budget["cpu_bytes"], park, estimates)
    summaries = {n: p["summary"] for n, p in policies.items() if "summary" in p}
    report["ratios"] = ratios(summaries, policies.get("park_wake", {}).get("timings", {}), names[0])
    report["budget_held"] = {
        name: not run["memory_during_stream"]["samples_over_budget"]
        and not run["memory_during_stream"]["samples_three_awake"]
        for name, run in policies.items()
        if name != "all_resident" and "memory_during_stream" in run
    }
    report["anomalies"] = anomalies(report)
    shutdowns = [p["shutdown"] for p in policies.values() if "shutdown" in p]
    report["engines_left_running"] = sorted(
        pid for d in shutdowns for pid in d["engines_left_running"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=60, help="requests in the stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skew", type=float, default=2.0, help="Zipf exponent of popularity")
    parser.add_argument("--rotate-every", type=int, default=20, help="requests per ranking")
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=300.0, help="per policy's stream")
    parser.add_argument("--margin", type=float, default=0.05, help="budget margin")
    parser.add_argument("--hold-wait-s", type=float, default=300.0, help="queue.max_wait_s")
    parser.add_argument("--budget", help="policies 2 and 3's cpu_bytes instead of the rule's")
    parser.add_argument("--resident-budget", default="64GiB", help="policy 1's cpu_bytes")
    parser.add_argument("--gemma", help="Gemma 3 GGUF (default: models/gemma-3-270m*.gguf)")
    parser.add_argument("--log-dir", help="gateway logs and configs (default: a new temp dir)")
    parser.add_argument("--out", default="bench-results/residency.json")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr
    )
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "residency: all resident vs cold swapping vs park/wake, one stream",
        **run_record(),
        "engine_has_sleep": engine_has_sleep(),
        "settings": vars(args),
        "goals": GOALS,
    }
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(main_async(args, report))
    finally:
        report["machine"]["load_average_at_end"] = os.getloadavg()
        report["wall_s"] = round(time.monotonic() - started, 1)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report)


if __name__ == "__main__":
    main()
