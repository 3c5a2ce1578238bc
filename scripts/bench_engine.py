"""Engine benchmark: every figure is a ratio against a baseline measured in the same run.

Sections (select with --sections; sizes are flags so that a slow CPU can run each one):
- limit:  the model's bare linear layers on the device's fast path at batch B, and their weights
          read once at the measured memory bandwidth, vs the engine's whole decode step at B, the
          step broken into the spans of the engine's step profile
          (engine/model/step_profile.py: schedule, batch, forward with attention and the qkv GEMMs
          run inside it, sample, postprocess); and the K/V bytes attention reads per step against
          a plain read of memory, sequential and block by block through the block tables (the
          floor no attention kernel gets under).
- hf:     16 requests x 128 output tokens: engine vs transformers generate() sequentially and as one
          static padded batch.
- mixed:  64 requests with mixed prompt (16-512) and output (16-256) lengths arriving over time:
          engine vs static batches of 16 through generate().
- prefix: a shared 1k-token system prompt: prefill time of later requests vs the first.
- memory: at a fixed KV budget, peak concurrent sequences vs contiguous max_model_len reservation,
          and KV slots wasted per live sequence.

Usage: .venv/bin/python scripts/bench_engine.py --out bench_engine.json [--sections limit,hf]
Arrival gaps in the mixed workload run on a virtual clock: idle time is skipped, not slept, for the
engine and the baseline alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

# OpenMP threads that spin-wait collapse when the cores are shared (figures:
# docs/PERFORMANCE.md#openmp-wait-policy); passive waiting costs little otherwise. Must be set
# before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from engine.model.cpu.kernels import build as kernels_build  # noqa: E402

# The sections, one module each: scripts/engine_bench/.
from scripts.engine_bench.hf import bench_hf  # noqa: E402
from scripts.engine_bench.limit import bench_limit  # noqa: E402
from scripts.engine_bench.memory import bench_memory  # noqa: E402
from scripts.engine_bench.mixed import bench_mixed  # noqa: E402
from scripts.engine_bench.prefix import bench_prefix  # noqa: E402
from scripts.engine_bench.shared import log  # noqa: E402

DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SECTIONS = ("limit", "hf", "mixed", "prefix", "memory")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="model dtype (the issue's figures: float32)")
    p.add_argument(
        "--quantization", default="auto", help="auto (a GGUF's own blocks), none, int8 or int4"
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's) or narrower")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--limit-context", type=int, default=128)
    p.add_argument("--limit-steps", type=int, default=8, help="timed steps per block")
    p.add_argument("--limit-rounds", type=int, default=3, help="blocks of each kind")
    p.add_argument("--hf-requests", type=int, default=16)
    p.add_argument("--hf-prompt-len", type=int, default=64)
    p.add_argument("--hf-output-len", type=int, default=128)
    p.add_argument("--hf-sequential-requests", type=int, default=4)
    p.add_argument("--mixed-requests", type=int, default=64)
    p.add_argument("--mixed-rate", type=float, default=2.0, help="arrivals per second")
    p.add_argument("--mixed-max-prompt", type=int, default=512)
    p.add_argument("--mixed-max-output", type=int, default=256)
    p.add_argument("--mixed-max-seqs", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--prefix-requests", type=int, default=5)
    p.add_argument("--memory-kv-mib", type=int, default=128)
    p.add_argument("--memory-max-model-len", type=int, default=2048)
    p.add_argument("--memory-requests", type=int, default=96)
    p.add_argument("--memory-max-prompt", type=int, default=96)
    p.add_argument("--memory-output-len", type=int, default=24)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    benches = {
        "limit": bench_limit,
        "hf": bench_hf,
        "mixed": bench_mixed,
        "prefix": bench_prefix,
        "memory": bench_memory,
    }
    report: dict = {
        "model": args.model,
        "threads": args.threads,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kernels_isa": kernels_build.isa(),
        "kv_cache_dtype": args.kv_cache_dtype,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch": torch.__version__,
        "device": "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sections": {},
    }
    for name in chosen:
        log(f"section {name}")
        started = time.perf_counter()
        report["sections"][name] = benches[name](args)
        report["sections"][name]["section_s"] = round(time.perf_counter() - started, 1)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
