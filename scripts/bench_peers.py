"""Modelyard's engine beside llama.cpp's llama-server on the same model and the same seeded load.

Builds llama-server from the llama.cpp pinned in llama-cpp-python's sdist (scripts/peers/
llama_cpp.py, cached), requantizes the Q4_1 GGUF to F16 for it, then runs each configuration
alone, one after another, in rounds of alternating order, at each concurrency: streamed
/v1/completions of fixed length (ignore_eos, temperature 0) through bench_serving's client.
Reports per (config, concurrency) the medians over rounds of output tok/s, TTFT and ITL p50/p99,
the server's peak RSS and requests completed/failed; Modelyard's ratios to llama-server; and
this machine's memory read bandwidth with the C=1 bound it sets for each weight format.

    python scripts/bench_peers.py --out bench-results/peers.json
    python scripts/bench_peers.py --configs modelyard-fp32,llama-q4_1 --concurrency 1,4 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Protocol

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a plain script: make `engine` and `scripts` importable
    sys.path.insert(0, str(REPO_ROOT))

from scripts.bench_residency import git_commit, machine  # noqa: E402
from scripts.measure import write_report  # noqa: E402
from scripts.peers import llama_cpp, llama_server  # noqa: E402
from scripts.peers.bandwidth import read_bandwidth  # noqa: E402
from scripts.peers.cells import CellRunner, Target, cell_specs  # noqa: E402
from scripts.peers.configs import (  # noqa: E402
    CONFIGS,
    DEFAULT_CONFIGS,
    Config,
    engine_flags,
    engine_quantizations,
    parse_concurrencies,
    parse_configs,
)
from scripts.peers.report import bandwidth_bounds, ratios, summarize  # noqa: E402
from scripts.peers.weights import read_tensors  # noqa: E402
from scripts.serving.engine_server import EngineServer  # noqa: E402
from scripts.serving.workload import parse_range  # noqa: E402

MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2"
# --spin-wait: how the gateway runs an engine alone on its machine (gateway/config/loading.py), as
# here; llama-server then gets the same OpenMP wait (llama_server.openmp_env)
ENGINE_FLAGS = "--max-num-seqs 64 --kv-cache-memory 1GiB --spin-wait"
ISA_CPU_FLAGS = ("avx2", "fma", "f16c", "bmi2", "avx_vnni")
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # shown before llama-server's command
LOG_DIR = Path(os.environ.get("TMPDIR", "/tmp"))


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add(
        "--configs",
        type=parse_configs,
        default=[CONFIGS[n] for n in DEFAULT_CONFIGS],
        help=f"comma-separated, from: {', '.join(CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)})",
    )
    add(
        "--concurrency",
        type=parse_concurrencies,
        default=[1, 4, 16, 32, 64],
        help="comma-separated fixed concurrencies (default 1,4,16,32,64)",
    )
    add("--rounds", type=int, default=2, help="rounds, in alternating config order (default 2)")
    add(
        "--num-requests",
        type=int,
        help="requests per cell, at least the concurrency (default max(16, 2 x concurrency))",
    )
    add("--max-seconds", type=float, default=120.0, help="time bound of each cell")
    add("--output-len", type=int, default=128, help="max_tokens of every request (ignore_eos)")
    add("--input-words", type=parse_range, default=(16, 256), help="prompt words N or MIN:MAX")
    add("--seed", type=int, default=0, help="workload seed")
    add("--warmup", type=int, default=2, help="untimed requests after each server start")
    add("--model", type=Path, default=MODEL, help="the Q4_1 GGUF both servers load")
    add("--engine-flags", default=ENGINE_FLAGS, help="python -m engine flags of every config")
    add(
        "--llama-flags",
        default="",
        help="extra llama-server flags of every llama config (e.g. --no-repack: see "
        "docs/PERFORMANCE.md for the CPUs whose repacked Q4_1 crashes llama-server at start-up)",
    )
    add(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="llama-server threads (default: the cores available, as the engine uses)",
    )
    add(
        "--isa",
        choices=sorted(llama_cpp.ISA_FLAGS),
        help="llama.cpp build ISA (default: avx2 when MODELYARD_CPU_ISA=avx2, else native)",
    )
    add("--ready-timeout", type=float, default=900.0, help="seconds a server gets to load")
    add("--out", type=Path, help="write the JSON report here too")
    args = p.parse_args(argv)
    if args.rounds < 1 or (args.num_requests is not None and args.num_requests < 1):
        p.error("--rounds and --num-requests must be >= 1")
    return args


def host_info(isa: str) -> dict:
    info = machine()
    try:
        flags = set(
            Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
        )
    except (OSError, IndexError):
        flags = set()
    wide = sorted(f for f in flags if f.startswith(("avx512", "amx")))
    info["cpu_flags"] = {f: f in flags for f in ISA_CPU_FLAGS} | {f: True for f in wide}
    info["modelyard_cpu_isa"] = os.environ.get(llama_cpp.ISA_ENV) or None
    info["isa_forced"] = isa != "native"
    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    return info


class Server(Protocol):  # EngineServer and LlamaServer
    def wait_ready(self, timeout: float) -> None: ...
    def stop(self) -> int | None: ...


def start_server(config: Config, args: argparse.Namespace, ctx: dict) -> tuple[Server, Target]:
    """Start ``config``'s server and wait for it; returns (the server, where to load it)."""
    log = LOG_DIR / f"bench-peers-{config.name}.log"
    parallel = max(args.concurrency)
    server: Server
    if config.server == "llama":
        model = ctx["models"][config.model]
        n_ctx = llama_server.context_size(parallel, 2 * args.input_words[1] + 16, args.output_len)
        env = llama_server.openmp_env(shlex.split(args.engine_flags))
        llama = llama_server.LlamaServer.start(
            ctx["build"].server, model, SERVED_NAME, args.threads, parallel, n_ctx, log, env,
            shlex.split(args.llama_flags),
        )  # fmt: skip
        server, target = llama, Target(llama.url, SERVED_NAME, llama.pid, fresh_connections=True)
        omp = {k: v for k, v in env.items() if k in OMP_VARS}
        ctx["commands"][config.name] = [*(f"{k}={v}" for k, v in omp.items()), *llama.command]
    else:
        flags = shlex.split(args.engine_flags) + ctx["engine_flags"][config.name]
        engine_args = ["--model", str(args.model), "--served-model-name", SERVED_NAME, *flags]
        engine = EngineServer(engine_args, log)
        server, target = engine, Target(engine.url, SERVED_NAME, engine.proc.pid)
        ctx["commands"][config.name] = [str(a) for a in engine.proc.args]
    print(f"starting {config.name} (log: {log})", file=sys.stderr)
    try:
        server.wait_ready(timeout=args.ready_timeout)
    except (RuntimeError, TimeoutError):
        server.stop()
        raise
    return server, target


def run_config(config: Config, args: argparse.Namespace, ctx: dict, rnd: int) -> dict:
    server, target = start_server(config, args, ctx)
    runner = CellRunner(target)
    cells = {}
    try:
        runner.warmup(args.warmup, args.seed + 1)
        for c in args.concurrency:
            count = max(args.num_requests, c) if args.num_requests else max(16, 2 * c)
            specs = cell_specs(count, args.seed, args.input_words, args.output_len, f"r{rnd}c{c}")
            run = runner.run(specs, c, args.max_seconds)
            cells[f"c{c}"] = run
            brief = {k: run[k] for k in ("completed", "failed", "rss_peak_mb")}
            brief["tok_s"] = round(run["output_tokens_per_s"], 1)
            print(json.dumps({"config": config.name, "c": c, **brief}), file=sys.stderr)
    finally:
        runner.close()
        server.stop()
    return cells


def prepare(args: argparse.Namespace, isa: str, out: dict) -> tuple[list[Config], dict]:
    """Build what the configs need; returns the configs that can run and the shared context."""
    ctx: dict = {"commands": {}, "engine_flags": {}, "models": {"q4_1": args.model}}
    runnable, skipped = [], {}
    choices = engine_quantizations()
    for config in args.configs:
        if config.server == "modelyard":
            flags, why = engine_flags(config, choices)
            if flags is None:
                skipped[config.name] = why
                continue
            ctx["engine_flags"][config.name] = flags
        runnable.append(config)
    out["llama_cpp"] = None
    if any(c.server == "llama" for c in runnable):
        print(f"llama.cpp {llama_cpp.VERSION} ({isa}): building or reusing", file=sys.stderr)
        ctx["build"] = build = llama_cpp.build(isa)
        out["llama_cpp"] = {
            "llama_cpp_python": llama_cpp.VERSION,
            "sdist_sha256": llama_cpp.SHA256,
            "isa": isa,
            "cmake_flags": llama_cpp.cmake_flags(isa),
            "build_dir": str(build.root),
            "server_version": llama_server.version(build.server),
        }
        if any(c.model == "f16" for c in runnable if c.server == "llama"):
            f16 = llama_server.f16_model(build.quantize, args.model, build.root.parent / "models")
            ctx["models"]["f16"] = f16
    out["models"] = {
        k: {"path": str(v), "bytes": v.stat().st_size} for k, v in ctx["models"].items()
    }
    if "f16" in out["models"]:
        out["models"]["f16"]["derived_from"] = "q4_1 via llama-quantize --allow-requantize F16"
    out["skipped"] = skipped
    return runnable, ctx


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    isa = args.isa or llama_cpp.isa_from_env()
    out: dict = {
        "schema": "modelyard.bench-peers/1",
        "config": {k: v for k, v in vars(args).items() if k != "configs"}
        | {"configs": [c.name for c in args.configs]},
        "host": host_info(isa),
        "versions": {"modelyard": git_commit(), "python": platform.python_version()},
    }
    out["config"] = json.loads(json.dumps(out["config"], default=str))
    print("measuring memory read bandwidth", file=sys.stderr)
    out["memory_bandwidth"] = read_bandwidth()
    configs, ctx = prepare(args, isa, out)
    out["rounds"], out["server_errors"] = [], {}
    for rnd in range(args.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        runs = {}
        for config in order:
            try:
                runs[config.name] = run_config(config, args, ctx, rnd)
            except (RuntimeError, TimeoutError) as error:  # one server failing to start
                print(f"{config.name}: {error}", file=sys.stderr)
                out["server_errors"].setdefault(config.name, []).append(f"round {rnd}: {error}")
        out["rounds"].append({"round": rnd, "order": [c.name for c in order], "runs": runs})
    out["commands"] = ctx["commands"]
    out["cells"] = cells = summarize(out["rounds"])
    out["ratios"] = ratios(cells)
    bandwidth = out["memory_bandwidth"]["best_gb_s"]
    names = [c.name for c in configs]
    out["bandwidth_bound"] = bandwidth_bounds(names, read_tensors(args.model), bandwidth, cells)
    out["host"]["load_average_at_end"] = os.getloadavg()
    out["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_report(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
