"""Structured outputs benchmark: what constrained decoding costs and what it buys.

Default: starts the engine (``python -m engine --model MODEL``) and, at each concurrency, sends
chat prompts constrained to a strict JSON schema (response_format json_schema), then the same
prompts free, each generating as many tokens as its constrained twin (so that the two cells batch
alike and only the grammar differs); reports output tokens/s (aggregate, and each stream's
decode rate) and their constrained/free ratio, the share of outputs that parse and validate
against the schema, for the constrained requests and for free ones left to end by themselves,
and, in-process, the grammar compile time (cold: new schemas; cached) through engine.structured's
compiler. Every run is bounded by --requests and --max-seconds.

``--libraries``: the library comparison behind the choice of llguidance: vocabulary setup,
compile of a typical schema (cold, cached) and the per-step mask cost (fill + apply) at batch 1
and 16, for llguidance and (where installed) xgrammar.

    python scripts/bench_structured.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out bench-results/structured.json
    python scripts/bench_structured.py --libraries --model models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a plain script: make `engine` and `scripts` importable
    sys.path.insert(0, str(REPO_ROOT))

from engine.core.sampling_params import StructuredOutput  # noqa: E402
from scripts.measure import write_report  # noqa: E402
from scripts.serving.engine_server import EngineServer  # noqa: E402
from scripts.serving.results import summary  # noqa: E402
from scripts.structured_bench import libraries  # noqa: E402
from scripts.structured_bench.load import Cell, run_cell  # noqa: E402
from scripts.structured_bench.workload import (  # noqa: E402
    INSTANCE,
    SCHEMA,
    is_valid,
    is_valid_leniently,
    prompts,
)

COMPILE_SAMPLES = 32  # distinct schemas compiled cold, then again from the cache


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--model", required=True, help="model path (HF folder or GGUF file)")
    add("--libraries", action="store_true", help="only compare llguidance and xgrammar")
    add("--concurrency", default="1,16", help="comma-separated concurrencies")
    add("--requests", type=int, default=32, help="requests per cell (kind x concurrency)")
    add("--max-tokens", type=int, default=96, help="max_tokens of every request")
    add("--max-seconds", type=float, default=300.0, help="time bound of each cell")
    add("--engine-args", default="", help="extra `python -m engine` flags")
    add("--out", type=Path, help="write the JSON report here too")
    return p.parse_args(argv)


def load_tokenizer(model: str) -> tuple[Any, int, list[int]]:
    """The model's tokenizer, vocabulary size and end tokens, as the engine loads them."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.model.loader import converted_gguf_dir

    path = Path(model)
    folder = converted_gguf_dir(path) if path.suffix == ".gguf" else path
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    vocab = config.get_text_config().vocab_size
    return tokenizer, vocab, [tokenizer.eos_token_id]


def compile_times(tokenizer: Any, vocab: int, eos: list[int]) -> dict:
    """engine.structured's compiler (a worker process's checks and compile, then the engine's
    build): COMPILE_SAMPLES new schemas, then each again from the cache; the compiler's setup and
    first compile (llguidance's vocabulary, the worker's start) apart."""
    from engine.structured.compiler import GrammarCompiler

    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, set(eos))
    compiler.compile(StructuredOutput("json_object"))
    first = time.perf_counter() - started
    constraints = [
        StructuredOutput("json_schema", json.dumps({**SCHEMA, "description": f"schema {i}"}))
        for i in range(COMPILE_SAMPLES)
    ]
    timings: dict[str, list[float]] = {"cold": [], "cached": []}
    for kind in timings:
        for constraint in constraints:
            started = time.perf_counter()
            compiler.compile(constraint).matcher()  # a sequence's start included
            timings[kind].append((time.perf_counter() - started) * 1e3)
    compiler.shutdown()
    return {
        "first_compile_with_setup_ms": round(first * 1e3, 1),
        **{f"{kind}_ms": _rounded(summary(values)) for kind, values in timings.items()},
    }


def _rounded(stats: dict) -> dict:
    return {k: None if v is None else round(v, 4) for k, v in stats.items()}


def request_bodies(count: int, max_tokens: int, constrained: bool, tag: str) -> list[dict]:
    bodies = []
    for prompt in prompts(count):
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": f"[{tag}] {prompt}"}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if constrained:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            }
        bodies.append(body)
    return bodies


def cell_report(cell: Cell) -> dict:
    done = [r for r in cell.results if r.error is None]
    tokens = sum(r.tokens for r in done)
    rates = [rate for r in done if (rate := r.decode_tokens_per_s) is not None]
    finishes: dict[str, int] = {}
    for r in done:
        finishes[str(r.finish_reason)] = finishes.get(str(r.finish_reason), 0) + 1
    return {
        "requests": len(cell.results),
        "errors": len(cell.results) - len(done),
        "error_samples": sorted({r.error or "" for r in cell.results if r.error})[:3],
        "duration_s": round(cell.duration_s, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / cell.duration_s, 2) if cell.duration_s else 0.0,
        "stream_decode_tokens_per_s": _rounded(summary(rates)),
        "finish_reasons": finishes,
        "valid_share": _share([is_valid(r.text) for r in done]),
        # of the outputs that ended by themselves: the grammar's guarantee (a max_tokens cut
        # leaves any output incomplete)
        "valid_share_of_stopped": _share(
            [is_valid(r.text) for r in done if r.finish_reason == "stop"]
        ),
        "valid_share_fences_stripped": _share([is_valid_leniently(r.text) for r in done]),
    }


def _share(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 4) if flags else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def matched_free_bodies(constrained: Cell, count: int, tag: str) -> list[dict]:
    """Free requests shaped like the constrained cell's: the same prompts, each generating as
    many tokens as its constrained twin did (ignore_eos), so both cells batch alike and only
    the grammar differs."""
    lengths = {r.index: max(1, r.tokens) for r in constrained.results}
    bodies = request_bodies(count, 1, False, tag)
    for index, body in enumerate(bodies):
        body["max_tokens"] = lengths.get(index, 1)
        body["ignore_eos"] = True
    return bodies


def serving(args: argparse.Namespace, concurrencies: list[int]) -> dict:
    """Per concurrency: the constrained cell, then free requests of the same lengths (the
    throughput baseline); once, at the highest concurrency, free requests left to end by
    themselves (the validity baseline: greedy outputs do not depend on the batch)."""
    engine_args = ["--model", args.model, "--served-model-name", "bench", *args.engine_args.split()]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / "bench-structured-engine.log"
    server = EngineServer(engine_args, log_path)
    print(f"starting engine (log: {log_path})", file=sys.stderr)
    cells: dict[str, dict] = {}

    def run(name: str, bodies: list[dict], concurrency: int) -> Cell:
        cell = asyncio.run(run_cell(server.url, bodies, concurrency, args.max_seconds))
        cells[name] = cell_report(cell)
        print(json.dumps({name: cells[name]}), file=sys.stderr)
        return cell

    try:
        server.wait_ready(timeout=900)
        warm = request_bodies(2, 8, True, "warm-up") + request_bodies(2, 8, False, "warm-up")
        asyncio.run(run_cell(server.url, warm, 2, 120))
        for c in concurrencies:  # tags keep each cell's prompts out of the others' prefix cache
            bodies = request_bodies(args.requests, args.max_tokens, True, f"json{c}")
            constrained = run(f"c{c}/json_schema", bodies, c)
            run(
                f"c{c}/free_same_lengths",
                matched_free_bodies(constrained, args.requests, f"free{c}"),
                c,
            )
        c = max(concurrencies)
        run(f"c{c}/free", request_bodies(args.requests, args.max_tokens, False, "natural"), c)
    finally:
        exit_code = server.stop()
    ratios = {
        f"c{c}": {
            key: _ratio(
                _get(cells[f"c{c}/json_schema"], key), _get(cells[f"c{c}/free_same_lengths"], key)
            )
            for key in ("output_tokens_per_s", "stream_decode_tokens_per_s.p50")
        }
        for c in concurrencies
    }
    return {"cells": cells, "constrained_over_free": ratios, "engine_exit_code": exit_code}


def _get(report: dict, key: str) -> float | None:
    value: Any = report
    for part in key.split("."):
        value = value[part]
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    out: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
        },
    }
    tokenizer, vocab, eos = load_tokenizer(args.model)
    if args.libraries:
        out["libraries"] = libraries.compare(tokenizer, vocab, eos, SCHEMA, INSTANCE, [1, 16])
    else:
        out["compile"] = compile_times(tokenizer, vocab, eos)
        out["serving"] = serving(args, concurrencies)
    out["host"]["loadavg_end"] = os.getloadavg()
    write_report(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
