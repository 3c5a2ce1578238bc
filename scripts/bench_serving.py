"""Load generator for any OpenAI-compatible server (this engine, the gateway, a peer).

Streams /v1/completions (or /v1/chat/completions) requests built from a seeded prompt set with
mixed lengths, either at fixed concurrencies (closed loop) or at a Poisson request rate (open
loop), and reports requests/s, output tokens/s and TTFT / inter-token / end-to-end latency
percentiles as JSON. Every run is bounded by --num-requests and --max-seconds.

In the same invocation it can also start the engine itself (--serve, with the engine's own flags
after it) and measure baselines on the same prompts: the engine driven offline in-process at the
same concurrency (what HTTP costs), and transformers generate() with static batches (--baseline-hf).
This file is the command line and the report; the parts are in scripts/serving/.

    python scripts/bench_serving.py --serve "--model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --served-model-name smollm2" --concurrency 1,4,16,32 --output-len 128 --offline \\
        --baseline-hf --out bench-results/serving.json
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model smollm2 \\
        --request-rate 4 --output-len 32:256 --num-requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a plain script: make `engine` and `scripts` importable
    sys.path.insert(0, str(REPO_ROOT))

from scripts.measure import write_report  # noqa: E402
from scripts.serving.baselines import hf_model, run_hf_static, run_offline  # noqa: E402
from scripts.serving.client import Client, run_concurrency, run_rate  # noqa: E402
from scripts.serving.engine_server import EngineServer  # noqa: E402
from scripts.serving.workload import RequestSpec, build_workload, parse_range, tagged  # noqa: E402


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--base-url", help="server to load (e.g. http://127.0.0.1:8000); or use --serve")
    add("--serve", metavar="ENGINE_FLAGS", help="start `python -m engine` with these flags")
    add("--model", help="model name to request (default: the first --served-model-name)")
    add("--endpoint", choices=["completions", "chat"], default="completions", help="API used")
    add("--api-key-env", help="env var holding a bearer key (never printed)")
    add("--concurrency", default="", help="comma-separated fixed concurrencies, e.g. 1,4,16,32")
    add("--request-rate", default="", help="comma-separated Poisson rates in requests/s")
    add("--num-requests", type=int, default=64, help="requests per run (upper bound)")
    add("--max-seconds", type=float, default=180.0, help="time bound of each run")
    add("--input-words", type=parse_range, default=(16, 256), help="prompt words N or MIN:MAX")
    add("--output-len", type=parse_range, default=(128, 128), help="max_tokens N or MIN:MAX")
    add("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    add("--seed", type=int, default=0, help="workload and arrival seed")
    add("--offline", action="store_true", help="also run the engine in-process (needs --serve)")
    add("--baseline-hf", action="store_true", help="also run transformers generate() batches")
    add("--hf-max-batch", type=int, default=32, help="largest static batch for --baseline-hf")
    add("--hf-batch", type=int, default=16, help="static batch size of the rate runs' baseline")
    add("--warmup", type=int, default=2, help="untimed requests before the first run")
    add("--out", type=Path, help="write the JSON report here too")
    args = p.parse_args(argv)
    if bool(args.base_url) == bool(args.serve):
        p.error("give exactly one of --base-url or --serve")
    if (args.offline or args.baseline_hf) and not args.serve:
        p.error("--offline and --baseline-hf need --serve (they load the same model)")
    if not args.concurrency and not args.request_rate:
        p.error("give --concurrency and/or --request-rate")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    rates = [float(r) for r in args.request_rate.split(",") if r]
    engine_args = shlex.split(args.serve) if args.serve else []
    served = None
    if "--served-model-name" in engine_args:
        served = engine_args[engine_args.index("--served-model-name") + 1]
    model = (
        args.model
        or served
        or (engine_args[engine_args.index("--model") + 1] if "--model" in engine_args else None)
    )
    if model is None:
        raise SystemExit("--model is required with --base-url")
    specs = build_workload(args.num_requests, args.seed, args.input_words, args.output_len)
    out: dict = {
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k != "api_key_env"
        },
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        },
        "runs": [],
    }
    server = None
    base_url = args.base_url
    if args.serve:
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / "bench-engine.log"
        server = EngineServer(engine_args, log_path)
        print(f"starting engine (log: {log_path})", file=sys.stderr)
        server.wait_ready(timeout=900)
        base_url = server.url
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    client = Client(base_url, model, args.endpoint, not args.no_ignore_eos, api_key)
    try:
        warm = build_workload(args.warmup, args.seed + 1, (8, 16), (8, 8))
        if warm:
            asyncio.run(run_concurrency(client, warm, len(warm), 120))
        for c in concurrencies:
            run = asyncio.run(run_concurrency(client, tagged(specs, f"c{c}"), c, args.max_seconds))
            out["runs"].append(run)
            print(json.dumps(_brief(run)), file=sys.stderr)
        for rate in rates:
            run_specs = tagged(specs, f"r{rate}")
            run = asyncio.run(run_rate(client, run_specs, rate, args.seed, args.max_seconds))
            out["runs"].append(run)
            print(json.dumps(_brief(run)), file=sys.stderr)
    finally:
        if server is not None:
            out["engine_exit_code"] = server.stop()
    rate_runs = [run for run in out["runs"] if run["mode"] == "poisson"]
    baselines = _baselines(args, engine_args, specs, concurrencies, rate_runs)
    out["baselines"] = baselines
    out["ratios"] = _ratios(out["runs"], baselines)
    out["host"]["loadavg_end"] = os.getloadavg()
    write_report(out, args.out)
    return 0


def _baselines(
    args: argparse.Namespace,
    engine_args: list[str],
    specs: list[RequestSpec],
    concurrencies: list[int],
    rate_runs: list[dict],
) -> list[dict]:
    baselines: list[dict] = []
    if args.offline:
        core = None
        warm = build_workload(args.warmup, args.seed + 1, (8, 16), (8, 8))
        if warm:
            _, core = run_offline(engine_args, warm, len(warm), 120)
        for c in concurrencies:
            run_specs = tagged(specs, f"c{c}")
            run, core = run_offline(engine_args, run_specs, c, args.max_seconds, core)
            baselines.append(run)
            print(json.dumps(_brief(run)), file=sys.stderr)
    if args.baseline_hf:
        model = hf_model(engine_args)
        for c in concurrencies:  # one static batch of the same first c prompts
            if c <= args.hf_max_batch and c <= len(specs):
                run_specs = tagged(specs[:c], f"c{c}")
                baselines.append(run_hf_static(model, run_specs, c, args.max_seconds))
                print(json.dumps(_brief(baselines[-1])), file=sys.stderr)
        if rate_runs:  # the whole request set the rate runs sent, in static batches
            sent = max(run["sent"] for run in rate_runs)
            run_specs = tagged(specs[:sent], "rate")
            run = run_hf_static(model, run_specs, args.hf_batch, args.max_seconds)
            run["for"] = "request-rate runs"
            baselines.append(run)
            print(json.dumps(_brief(run)), file=sys.stderr)
    return baselines


def _ratios(runs: list[dict], baselines: list[dict]) -> dict:
    ratios = {}
    for run in runs:
        if run["mode"] != "concurrency":
            continue
        c = run["concurrency"]
        entry = {}
        for base in baselines:
            if "for" in base or base.get("concurrency", base.get("batch")) != c:
                continue
            key = (
                "http_over_offline_engine"
                if base["mode"] == "offline-engine"
                else ("http_over_hf_static_batch")
            )
            entry[key] = ratio(run["output_tokens_per_s"], base["output_tokens_per_s"])
        if entry:
            ratios[f"c{c}"] = entry
    return ratios


def _brief(run: dict) -> dict:
    keys = ("mode", "concurrency", "request_rate", "batch", "completed", "errors")
    brief = {k: run[k] for k in keys if k in run}
    brief["out_tok_s"] = round(run["output_tokens_per_s"], 1)
    for name in ("ttft_s", "itl_s"):
        brief[name] = {
            q: round(v, 4) for q, v in run[name].items() if v is not None and q != "mean"
        }
    return brief


if __name__ == "__main__":
    sys.exit(main())
