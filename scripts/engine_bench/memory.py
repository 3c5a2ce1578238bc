"""Section ``memory``: at a fixed KV budget, peak concurrent sequences vs a contiguous
max_model_len reservation, and the KV slots wasted per live sequence."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.core.sampling_params import SamplingParams
from scripts.engine_bench.shared import make_core, token_prompt


def bench_memory(args: argparse.Namespace) -> dict:
    budget = args.memory_kv_mib * 2**20
    core = make_core(
        args,
        kv_cache_memory=budget,
        max_model_len=args.memory_max_model_len,
        max_num_seqs=args.memory_requests,
        max_num_batched_tokens=max(2048, args.memory_requests),
    )
    block_size = core.config.block_size
    num_blocks = core.stats().num_blocks
    contiguous = (num_blocks * block_size) // args.memory_max_model_len
    rng = random.Random(args.seed + 4)
    params = SamplingParams(temperature=0.0, max_tokens=args.memory_output_len, ignore_eos=True)
    for i in range(args.memory_requests):
        prompt = token_prompt(core, rng, rng.randint(32, args.memory_max_prompt))
        core.add_request(f"mem-{i}", prompt, params)
    peak, waste_max, waste_samples = 0, 0, []
    deadline = time.monotonic() + 3600
    while core.has_unfinished() and time.monotonic() < deadline:
        core.step()
        running = core.scheduler.running
        peak = max(peak, len(running))
        for seq in running:
            # Slots allocated beyond what the sequence holds (its newest token included).
            waste = max(0, len(seq.block_table) * block_size - seq.num_tokens)
            waste_max = max(waste_max, waste)
            waste_samples.append(waste)
    return {
        "kv_budget_mib": args.memory_kv_mib,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_model_len": args.memory_max_model_len,
        "contiguous_reservation_max_seqs": contiguous,
        "engine_peak_concurrent_seqs": peak,
        "concurrency_over_contiguous": round(peak / max(contiguous, 1), 2),
        "kv_waste_slots_per_seq_mean": round(statistics.mean(waste_samples), 2),
        "kv_waste_blocks_per_seq_max": round(waste_max / block_size, 3),
        "preemptions": core.stats().num_preemptions,
    }
