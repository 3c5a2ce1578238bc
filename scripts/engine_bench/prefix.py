"""Section ``prefix``: a shared system prompt; the prefill time of later requests vs the first."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.core.sampling_params import SamplingParams
from scripts.engine_bench.shared import drain, make_core, sync, token_prompt


def bench_prefix(args: argparse.Namespace) -> dict:
    core = make_core(args, max_num_batched_tokens=max(2048, args.prefix_len + 64))
    rng = random.Random(args.seed + 3)
    system = token_prompt(core, rng, args.prefix_len)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill_s = []
    for i in range(args.prefix_requests):
        prompt = system + token_prompt(core, rng, 24)
        sync(core.runner.device)
        started = time.perf_counter()
        core.add_request(f"prefix-{i}", prompt, params)
        drain(core)  # max_tokens=1: the time to the first token is the prefill
        prefill_s.append(time.perf_counter() - started)
    later = statistics.mean(prefill_s[1:])
    stats = core.stats()
    return {
        "shared_prefix_tokens": args.prefix_len,
        "requests": args.prefix_requests,
        "first_prefill_ms": round(prefill_s[0] * 1e3, 1),
        "later_prefill_ms_mean": round(later * 1e3, 1),
        "speedup": round(prefill_s[0] / later, 2),
        "prefix_cache_hit_rate": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 3),
    }
