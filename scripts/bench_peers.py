"""Modelyard's engine beside llama.cpp's llama-server on the same GGUF and the same seeded load.

Any GGUF, and several (--model, repeatable: each benched in turn, served under a name from its
file name). Builds llama-server from the llama.cpp pinned in llama-cpp-python's sdist
(scripts/peers/llama_cpp.py, cached), then per model runs each configuration alone, one after
another, in rounds of alternating order, at each concurrency: streamed /v1/completions of fixed
length (ignore_eos, temperature 0) through bench_serving's client. Reports per model and (config,
concurrency) the medians over rounds of output tok/s, TTFT and ITL p50/p99, requests
completed/failed; per server its spawn-to-ready time and RSS after load and at peak under load;
Modelyard's ratios to llama-server on the same file; and this machine's memory read bandwidth
with the C=1 bound it sets for each weight format.

    python scripts/bench_peers.py --out bench-results/peers.json
    python scripts/bench_peers.py --model models/gemma-3-270m-q4_k_m.gguf \\
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --concurrency 1,16 --rounds 1
    python scripts/bench_peers.py --configs modelyard-int4,modelyard-fp32,llama-q4_1,llama-f16
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

from common.processes import rss_bytes  # noqa: E402
from scripts.attacks.rss import MIB  # noqa: E402
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
    file_type_mismatch,
    parse_concurrencies,
    parse_configs,
)
from scripts.peers.model_file import ModelFile, open_models  # noqa: E402
from scripts.peers.report import (  # noqa: E402
    bandwidth_bounds,
    ratios,
    server_ratios,
    servers_summary,
    summarize,
    summary_table,
)
from scripts.peers.weights import read_tensors  # noqa: E402
from scripts.serving.engine_server import EngineServer  # noqa: E402
from scripts.serving.workload import parse_range  # noqa: E402

MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    add(
        "--model",
        type=Path,
        action="append",
        help="a GGUF both servers load; repeat it for several (default: SmolLM2's Q4_1)",
    )
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
    args.model = args.model or [MODEL]
    missing = [str(m) for m in args.model if not m.is_file()]
    if missing:
        p.error(f"--model: no such file: {', '.join(missing)}")
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
    """Start ``config``'s server on ``ctx["model"]`` and wait for it; returns (the server, where
    to load it)."""
    model: ModelFile = ctx["model"]
    log = LOG_DIR / f"bench-peers-{model.name}-{config.name}.log"
    parallel = max(args.concurrency)
    server: Server
    if config.server == "llama":
        path = ctx["files"][config.model]
        n_ctx = llama_server.context_size(parallel, 2 * args.input_words[1] + 16, args.output_len)
        env = llama_server.openmp_env(shlex.split(args.engine_flags))
        llama = llama_server.LlamaServer.start(
            ctx["build"].server, path, model.name, args.threads, parallel, n_ctx, log, env,
            shlex.split(args.llama_flags),
        )  # fmt: skip
        server, target = llama, Target(llama.url, model.name, llama.pid, fresh_connections=True)
        omp = {k: v for k, v in env.items() if k in OMP_VARS}
        ctx["commands"][config.name] = [*(f"{k}={v}" for k, v in omp.items()), *llama.command]
    else:
        flags = shlex.split(args.engine_flags) + ctx["engine_flags"][config.name]
        engine_args = ["--model", str(model.path), "--served-model-name", model.name, *flags]
        engine = EngineServer(engine_args, log)
        server, target = engine, Target(engine.url, model.name, engine.proc.pid)
        ctx["commands"][config.name] = [str(a) for a in engine.proc.args]
    print(f"starting {config.name} on {model.name} (log: {log})", file=sys.stderr)
    try:
        server.wait_ready(timeout=args.ready_timeout)
    except (RuntimeError, TimeoutError):
        server.stop()
        raise
    return server, target


def run_config(config: Config, args: argparse.Namespace, ctx: dict, rnd: int) -> tuple[dict, dict]:
    """One server's cells, and its start: seconds from spawn to ready, RSS once ready."""
    t0 = time.monotonic()
    server, target = start_server(config, args, ctx)
    rss = rss_bytes(target.pid)
    startup = {
        "ready_s": round(time.monotonic() - t0, 3),
        "rss_after_load_mb": round(rss / MIB, 1) if rss is not None else None,
    }
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
            line = {"model": target.model, "config": config.name, "c": c, **brief}
            print(json.dumps(line), file=sys.stderr)
    finally:
        runner.close()
        server.stop()
    return cells, startup


def prepare_llama(configs: list[Config], isa: str) -> tuple[llama_cpp.Build | None, dict | None]:
    """The llama.cpp build when a configuration needs one, and what the report says of it."""
    if not any(c.server == "llama" for c in configs):
        return None, None
    print(f"llama.cpp {llama_cpp.VERSION} ({isa}): building or reusing", file=sys.stderr)
    build = llama_cpp.build(isa)
    return build, {
        "llama_cpp_python": llama_cpp.VERSION,
        "sdist_sha256": llama_cpp.SHA256,
        "isa": isa,
        "cmake_flags": llama_cpp.cmake_flags(isa),
        "build_dir": str(build.root),
        "server_version": llama_server.version(build.server),
    }


def prepare(
    args: argparse.Namespace, model: ModelFile, build: llama_cpp.Build | None, out: dict
) -> tuple[list[Config], dict]:
    """What the configs need on ``model``; returns those that can run and their context."""
    ctx: dict = {"commands": {}, "engine_flags": {}, "model": model, "build": build}
    ctx["files"] = {"file": model.path}
    runnable, skipped = [], {}
    choices = engine_quantizations()
    for config in args.configs:
        why = file_type_mismatch(config, model.file_type)
        if why is None and config.server == "modelyard":
            ctx["engine_flags"][config.name], why = engine_flags(config, choices)
        if why is not None:
            skipped[config.name] = why
            continue
        runnable.append(config)
    if build is not None and any(c.model == "f16" for c in runnable if c.server == "llama"):
        f16 = llama_server.f16_model(build.quantize, model.path, build.root.parent / "models")
        ctx["files"]["f16"] = f16
    out["file"] = model.describe()
    out["files"] = {k: {"path": str(v), "bytes": v.stat().st_size} for k, v in ctx["files"].items()}
    if "f16" in out["files"]:
        out["files"]["f16"]["derived_from"] = "the file via llama-quantize --allow-requantize F16"
    out["skipped"] = skipped
    return runnable, ctx


def bench_model(
    model: ModelFile, args: argparse.Namespace, build: llama_cpp.Build | None, bandwidth: float
) -> dict:
    """Every configuration on ``model``, in rounds of alternating order: its part of the report."""
    out: dict = {"served_name": model.name}
    configs, ctx = prepare(args, model, build, out)
    out["rounds"], out["server_errors"] = [], {}
    for rnd in range(args.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        runs, startup = {}, {}
        for config in order:
            try:
                runs[config.name], startup[config.name] = run_config(config, args, ctx, rnd)
            except (RuntimeError, TimeoutError) as error:  # one server failing to start
                print(f"{model.name} {config.name}: {error}", file=sys.stderr)
                out["server_errors"].setdefault(config.name, []).append(f"round {rnd}: {error}")
        order_names = [c.name for c in order]
        out["rounds"].append({"round": rnd, "order": order_names, "runs": runs, "startup": startup})
    out["commands"] = ctx["commands"]
    out["cells"] = cells = summarize(out["rounds"])
    out["servers"] = servers = servers_summary(out["rounds"])
    out["ratios"] = ratios(cells)
    out["server_ratios"] = server_ratios(servers)
    names = [c.name for c in configs]
    out["bandwidth_bound"] = bandwidth_bounds(names, read_tensors(model.path), bandwidth, cells)
    print(summary_table(model.name, cells, servers, args.concurrency), file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    isa = args.isa or llama_cpp.isa_from_env()
    out: dict = {
        "schema": "modelyard.bench-peers/2",
        "config": {k: v for k, v in vars(args).items() if k != "configs"}
        | {"configs": [c.name for c in args.configs]},
        "host": host_info(isa),
        "versions": {"modelyard": git_commit(), "python": platform.python_version()},
    }
    out["config"] = json.loads(json.dumps(out["config"], default=str))
    models = open_models(args.model)
    print("measuring memory read bandwidth", file=sys.stderr)
    out["memory_bandwidth"] = read_bandwidth()
    build, out["llama_cpp"] = prepare_llama(args.configs, isa)
    bandwidth = out["memory_bandwidth"]["best_gb_s"]
    out["models"] = {m.name: bench_model(m, args, build, bandwidth) for m in models}
    out["host"]["load_average_at_end"] = os.getloadavg()
    out["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_report(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
