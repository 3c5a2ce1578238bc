"""Section ``mixed``: requests of mixed prompt and output lengths arriving over time (a virtual
clock: idle gaps are skipped), the engine vs static batches of 16 through generate()."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from torch import nn

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from scripts.engine_bench.hf import hf_generate, load_hf
from scripts.engine_bench.shared import log, make_core, token_prompt


def mixed_workload(
    core: EngineCore, args: argparse.Namespace
) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt, output length) per request, Poisson arrivals, seeded."""
    rng = random.Random(args.seed + 2)
    now, requests = 0.0, []
    for _ in range(args.mixed_requests):
        now += rng.expovariate(args.mixed_rate)
        prompt = token_prompt(core, rng, rng.randint(16, args.mixed_max_prompt))
        requests.append((now, prompt, rng.randint(16, args.mixed_max_output)))
    return requests


def run_engine_mixed(core: EngineCore, workload: list) -> dict:
    """Feed requests at their arrival times (virtual clock: idle gaps are skipped)."""
    skipped = 0.0
    started = time.perf_counter()
    pending = list(enumerate(workload))
    done: dict[str, float] = {}

    def clock() -> float:
        return time.perf_counter() - started + skipped

    while pending or core.has_unfinished():
        now = clock()
        while pending and pending[0][1][0] <= now:
            i, (_, prompt, out_len) = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
            core.add_request(f"mixed-{i}", prompt, params)
        if not core.has_unfinished():
            skipped += pending[0][1][0] - now  # idle until the next arrival
            continue
        for out in core.step():
            if out.finished:
                done[out.request_id] = clock()
    latencies = [done[f"mixed-{i}"] - w[0] for i, w in enumerate(workload)]
    return {"makespan_s": max(done.values()) - workload[0][0], "latencies": latencies}


def run_static_mixed(model: nn.Module, workload: list, batch: int, pad_id: int) -> dict:
    """Static batches of ``batch`` in arrival order; each runs to its longest output."""
    free_at, latencies = 0.0, []
    for start in range(0, len(workload), batch):
        group = workload[start : start + batch]
        begin = max(free_at, group[-1][0])  # a static batch starts once it is full
        elapsed, _ = hf_generate(model, [p for _, p, _ in group], max(n for *_, n in group), pad_id)
        free_at = begin + elapsed
        latencies += [free_at - arrival for arrival, _, _ in group]
        log(f"mixed: static batch {start // batch} took {elapsed:.1f}s")
    return {"makespan_s": free_at - workload[0][0], "latencies": latencies}


def bench_mixed(args: argparse.Namespace) -> dict:
    core = make_core(args, max_num_seqs=args.mixed_max_seqs)
    model = load_hf(core)
    workload = mixed_workload(core, args)
    useful = sum(n for *_, n in workload)
    engine = run_engine_mixed(core, workload)
    log(f"mixed: engine makespan {engine['makespan_s']:.1f}s")
    static = run_static_mixed(model, workload, 16, core.tokenizer.pad_token_id or 0)
    engine_tps = useful / engine["makespan_s"]
    static_tps = useful / static["makespan_s"]
    return {
        "requests": len(workload),
        "arrival_rate_per_s": args.mixed_rate,
        "prompt_len_range": [16, args.mixed_max_prompt],
        "output_len_range": [16, args.mixed_max_output],
        "useful_output_tokens": useful,
        "engine_tokens_per_s": round(engine_tps, 1),
        "static16_tokens_per_s": round(static_tps, 1),
        "engine_over_static16": round(engine_tps / static_tps, 2),
        "engine_latency_p50_s": round(statistics.median(engine["latencies"]), 2),
        "static16_latency_p50_s": round(statistics.median(static["latencies"]), 2),
        "engine_preemptions": core.stats().num_preemptions,
    }
