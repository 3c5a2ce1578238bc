#!/usr/bin/env python
"""Density: how many copies of one GGUF (distinct served names) are awake at once in a fixed memory
budget, and the request latency with them all awake; Modelyard vs llama-server processes on the
same file. JSON out (stdout, and --out).

Modelyard: a gateway (``modelyard serve``) with --max-copies on-demand copies of the file and
``gateway.memory.cpu_bytes`` = --budget, park on; each copy plans with the awake footprint one copy
measured alone first. Copies are loaded one by one (a request each) until the gateway parks one to
make room (or a load fails); the most awake at once is the count. Then a round of --requests
streamed completions of --max-tokens from --clients clients across the copies awake (p50/p99
latency), each engine's PSS and RSS (its GET /status), one copy parked by hand, and the memory
again. llama-server: processes on the file, each with the same context (-c --context, one unified
KV cache for --clients slots), started one by one with a request each while their summed RSS and
one more stay within the budget; the same round. Every loop is bounded in count (--max-copies)
and time (--fill-seconds, --round-seconds); every process started is stopped at the end.

    python scripts/bench_density.py --out bench-results/density.json
    python scripts/bench_density.py --model models/gemma-3-270m-q4_k_m.gguf --budget 4GiB
    python scripts/bench_density.py --servers modelyard --max-copies 4
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a plain script: make `scripts` and `common` importable
    sys.path.insert(0, str(REPO_ROOT))

from common.sizes import parse_size  # noqa: E402
from scripts.bench_residency import run_record  # noqa: E402
from scripts.density_bench import llama, modelyard  # noqa: E402
from scripts.density_bench.settings import Settings  # noqa: E402
from scripts.density_bench.summary import summarize  # noqa: E402
from scripts.measure import write_report  # noqa: E402
from scripts.peers import llama_cpp, llama_server  # noqa: E402
from scripts.peers.model_file import kv_bytes_per_token, open_models  # noqa: E402

MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SIDES = ("modelyard", "llama")
log = logging.getLogger("bench_density")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _sides(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(SIDES):
        raise argparse.ArgumentTypeError(f"bad --servers {text!r}: from {','.join(SIDES)}")
    return list(dict.fromkeys(names))


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--model", type=Path, default=MODEL, help="the GGUF every copy serves (default SmolLM2)")
    add("--budget", type=_size, default=parse_size("8GiB"), help="memory budget (default 8GiB)")
    add("--servers", type=_sides, default=list(SIDES), help="modelyard,llama (default both)")
    add("--max-copies", type=int, default=64, help="copies tried at most, per side (default 64)")
    add("--context", type=int, default=4096, help="KV tokens per copy (default 4096)")
    add("--clients", type=int, default=2, help="concurrent clients of the round (default 2)")
    add("--requests", type=int, default=32, help="requests in the round (default 32)")
    add("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    add("--fill-seconds", type=float, default=900.0, help="no copy starts after this, per side")
    add("--round-seconds", type=float, default=300.0, help="time bound of each round")
    add("--load-timeout", type=float, default=300.0, help="seconds one copy gets to start")
    add(
        "--memory-estimate",
        type=_size,
        help="Modelyard copies plan with this awake footprint (default: one copy measured alone)",
    )
    add("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server threads")
    add("--llama-flags", default="", help="extra flags of every llama-server")
    add("--isa", choices=sorted(llama_cpp.ISA_FLAGS), help="llama.cpp build ISA (see bench_peers)")
    add("--log-dir", type=Path, help="configs and server logs (default: a new temp dir)")
    add("--out", type=Path, help="write the JSON report here too")
    args = p.parse_args(argv)
    positive = ("max_copies", "context", "clients", "requests", "max_tokens", "budget")
    if any(getattr(args, k) < 1 for k in positive):
        p.error("--max-copies, --context, --clients, --requests, --max-tokens, --budget: >= 1")
    if not args.model.is_file():
        p.error(f"--model: no such file: {args.model}")
    return args


def settings(args: argparse.Namespace, log_dir: Path) -> Settings:
    (model,) = open_models([args.model])
    return Settings(
        model=model,
        budget_bytes=args.budget,
        max_copies=args.max_copies,
        context=args.context,
        clients=args.clients,
        requests=args.requests,
        max_tokens=args.max_tokens,
        fill_seconds=args.fill_seconds,
        round_seconds=args.round_seconds,
        load_timeout=args.load_timeout,
        log_dir=log_dir,
    )


async def run(args: argparse.Namespace, s: Settings, out: dict[str, Any]) -> None:
    """Each side in turn, alone on the machine; each records its own failure."""
    if "modelyard" in args.servers:
        out["modelyard"] = await modelyard.run(s, args.memory_estimate)
    if "llama" in args.servers:
        isa = args.isa or llama_cpp.isa_from_env()
        log.info("llama.cpp %s (%s): building or reusing", llama_cpp.VERSION, isa)
        build = await asyncio.to_thread(llama_cpp.build, isa)
        out["llama_cpp"] = {"isa": isa, "server_version": llama_server.version(build.server)}
        extra = shlex.split(args.llama_flags)
        out["llama"] = await llama.run(s, build.server, args.threads, extra)


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-density-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    s = settings(args, log_dir)
    started = time.monotonic()
    out: dict[str, Any] = {
        "schema": "modelyard.bench-density/1",
        **run_record(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": s.model.describe()
        | {"served_name": s.model.name, "kv_bytes_per_token": kv_bytes_per_token(s.model.path)},
        "log_dir": str(log_dir),
    }
    try:
        asyncio.run(run(args, s, out))
    finally:
        out["summary"] = summarize(out.get("modelyard"), out.get("llama"))
        out["machine"]["load_average_at_end"] = os.getloadavg()
        out["wall_s"] = round(time.monotonic() - started, 1)
        write_report(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
