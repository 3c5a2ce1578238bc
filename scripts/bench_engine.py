"""Engine benchmark: every figure is a ratio against a baseline measured in the same run.

Sections (select with --sections; sizes are flags so that a slow CPU can run each one):
- limit:  the model's bare linear layers on the device's fast path at batch B vs the engine's whole
          decode step at B, the step broken into the spans of the engine's step profile
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
import contextlib
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# OpenMP threads that spin-wait collapse when the cores are shared (figures:
# docs/PERFORMANCE.md#openmp-wait-policy); passive waiting costs little otherwise. Must be set
# before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.model.cpu.kernels.build import available  # noqa: E402
from engine.model.cpu.kernels.paged_decode import read_paged_kv  # noqa: E402
from engine.model.cpu.linear import PrepackedLinear, StepGemms  # noqa: E402
from engine.model.step_profile import ATTENTION, FORWARD, StepProfile  # noqa: E402

DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SECTIONS = ("limit", "hf", "mixed", "prefix", "memory")
WORDS = [
    "river",
    "mountain",
    "engine",
    "token",
    "cache",
    "block",
    "paged",
    "batch",
    "schedule",
    "model",
    "garden",
    "quiet",
    "bright",
    "number",
    "seven",
    "apple",
    "orange",
    "window",
    "letter",
    "simple",
    "market",
    "silver",
    "planet",
    "music",
]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def make_core(args: argparse.Namespace, **overrides: object) -> EngineCore:
    options = {
        "model": args.model,
        "num_threads": args.threads,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "device": args.device,
        "max_model_len": 2048,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory": 1024 * 2**20,
    }
    options.update(overrides)
    return EngineCore(EngineConfig(**options))


def token_prompt(core: EngineCore, rng: random.Random, length: int) -> list[int]:
    """A prompt of exactly ``length`` tokens of ordinary words."""
    ids: list[int] = []
    while len(ids) < length:
        text = " ".join(rng.choice(WORDS) for _ in range(64))
        ids += core.tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:length]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drain(core: EngineCore, limit_s: float = 3600.0) -> None:
    deadline = time.monotonic() + limit_s
    while core.has_unfinished():
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not finish in time")
        core.step()


# ---------------------------------------------------------------------------------- limit
def model_linears(core: EngineCore) -> list[nn.Module]:
    """The engine's linear modules in execution order (prepacked on CPU, nn.Linear on CUDA)."""
    kinds = (PrepackedLinear, nn.Linear)
    return [m for m in core.runner.model.modules() if isinstance(m, kinds)]


def linear_pass(core: EngineCore, modules: list[nn.Module], batch: int, packed: bool):
    """A callable timing one pass over every linear at ``batch`` rows (one decode step's GEMMs):
    through the engine's own modules, called as the lean forward calls them, under the engine's
    thread policy (``packed``), or plain F.linear on unpacked weights of the same shapes on all
    threads."""
    device, dtype = core.runner.device, core.runner.loaded.dtype
    weights = [
        torch.randn(m.out_features, m.in_features, device=device, dtype=dtype) for m in modules
    ]
    inputs = {
        w.shape[1]: torch.randn(batch, w.shape[1], device=device, dtype=dtype) for w in weights
    }
    threads = (lambda: core.runner.compute_threads(batch)) if packed else contextlib.nullcontext

    @torch.inference_mode()
    def run() -> float:
        sync(device)
        started = time.perf_counter()
        with threads():
            if packed:
                gemms = StepGemms(batch)
                for module in modules:
                    gemms(module, inputs[module.in_features])
            else:
                for weight in weights:
                    F.linear(inputs[weight.shape[1]], weight)
        sync(device)
        return time.perf_counter() - started

    run()  # warm-up
    return run


def timed_step(core: EngineCore) -> float:
    device = core.runner.device
    sync(device)
    started = time.perf_counter()
    core.step()
    sync(device)
    return time.perf_counter() - started


def memory_read_gb_per_s(device: torch.device) -> float:
    """What a plain read of 1 GiB (a sum, on torch's threads) gets from this machine's memory:
    the speed limit for attention, which reads every K/V byte of the context once per step."""
    data = torch.ones(1 << 28, device=device)
    best = math.inf
    for _ in range(4):
        sync(device)
        started = time.perf_counter()
        data.sum()
        sync(device)
        best = min(best, time.perf_counter() - started)
    return data.numel() * data.element_size() / best / 1e9


def paged_kv_read(core: EngineCore, kv_bytes_per_token: int) -> Callable[[], float] | None:
    """A callable reading what the next decode step's attention reads, through the running
    sequences' block tables, and nothing else (read_paged_kv, on all the engine's
    threads); it returns its GB/s. None off the CPU kernels. Paged blocks are not one sequential
    stream: this is the floor for attention over this memory and this cache layout, which a
    1 GiB sum is not. Reads run back to back, so a small batch's K/V (which in a step the weights
    evict) may partly come from cache: a floor on the optimistic side."""
    if core.runner.cpu is None or not available():
        return None

    def run() -> float:
        running = core.scheduler.running
        width = max(len(s.block_table) for s in running)
        padded = [s.block_table + [0] * (width - len(s.block_table)) for s in running]
        tables = torch.tensor(padded, dtype=torch.int32)
        seq_lens = torch.tensor([s.num_tokens for s in running], dtype=torch.int32)
        started = time.perf_counter()
        read_paged_kv(core.runner.kv_caches, tables, seq_lens, core.runner.cpu.threads)
        elapsed = time.perf_counter() - started
        return int(seq_lens.sum()) * kv_bytes_per_token / elapsed / 1e9

    return run


def bench_limit(args: argparse.Namespace) -> dict:
    batches = [int(b) for b in args.batch_sizes.split(",")]
    core = make_core(args, max_num_seqs=max(batches))
    profile: StepProfile = core.profile
    profile.enabled = True
    linears = model_linears(core)
    read_gb_per_s = memory_read_gb_per_s(core.runner.device)
    spec = core.runner.spec
    kv_bytes_per_token = spec.bytes_per_block // spec.block_size  # K and V, all layers
    rng = random.Random(args.seed)
    total_steps = args.limit_rounds * (args.limit_steps + 1)
    params = SamplingParams(temperature=0.0, max_tokens=total_steps + 8, ignore_eos=True)
    results = []
    for batch in batches:
        for i in range(batch):
            core.add_request(
                f"limit-{batch}-{i}", token_prompt(core, rng, args.limit_context), params
            )
        # Run the prefills and two warm-up decodes, then time steps where all B sequences decode.
        for _ in range(10_000):
            running = core.scheduler.running
            if len(running) == batch and all(s.num_uncomputed_tokens == 1 for s in running):
                break
            core.step()
        core.step()
        core.step()
        packed_pass = linear_pass(core, linears, batch, packed=True)
        plain_pass = linear_pass(core, linears, batch, packed=False)
        read_pass = paged_kv_read(core, kv_bytes_per_token)
        # Steady state of each, in alternating blocks so that load from other processes hits all
        # alike: a block of consecutive engine steps, then of bare linear passes, of plain
        # F.linear passes and of paged K/V reads; the first of each block is a warm-up (caches
        # hold the previous block's data). Medians of the rest.
        steps, packed, plain, reads = [], [], [], []
        kinds = [(steps, lambda: timed_step(core)), (packed, packed_pass), (plain, plain_pass)]
        kinds += [(reads, read_pass)] if read_pass else []
        context_before = sum(s.num_tokens for s in core.scheduler.running)
        profile.reset()
        for _ in range(args.limit_rounds):
            for samples, run in kinds:
                run()
                samples.extend(run() for _ in range(args.limit_steps))
        assert profile.steps == total_steps  # every step of the blocks, warm-ups included
        context_after = sum(s.num_tokens for s in core.scheduler.running)
        kv_bytes = (context_before + context_after) / 2 * kv_bytes_per_token  # mean per step
        attention_floor_s = kv_bytes / (read_gb_per_s * 1e9)
        paged_floor_s = kv_bytes / (statistics.median(reads) * 1e9) if reads else None
        for i in range(batch):
            core.abort(f"limit-{batch}-{i}")
        step_s, linear_s = statistics.median(steps), statistics.median(packed)
        per_step_ms = profile.per_step_ms()
        # attention's own time: its calls less the qkv GEMMs the fused decode calls ran inside
        attention_s = profile.self_seconds(ATTENTION) / profile.steps
        forward_s = profile.seconds(FORWARD) / profile.steps
        row = {
            "batch": batch,
            "context_tokens": args.limit_context,
            "engine_step_ms": round(step_s * 1e3, 2),
            "bare_linears_ms": round(linear_s * 1e3, 2),
            "f_linear_unpacked_ms": round(statistics.median(plain) * 1e3, 2),
            "step_over_linears": round(step_s / linear_s, 3),
            # K/V that attention reads per step, the time a plain read of it takes, and the
            # ratio a step would have if it were only the linears plus that read
            "kv_read_mb_per_step": round(kv_bytes / 1e6, 1),
            "attention_floor_ms": round(attention_floor_s * 1e3, 2),
            "step_over_linears_floor": round((linear_s + attention_floor_s) / linear_s, 3),
            # the same with the K/V read as attention reads it: block by block through the
            # block tables (null off the CPU kernels)
            "kv_paged_read_gb_per_s": round(statistics.median(reads), 1) if reads else None,
            "attention_paged_floor_ms": round(paged_floor_s * 1e3, 2) if reads else None,
            "step_over_linears_paged_floor": (
                round((linear_s + paged_floor_s) / linear_s, 3) if reads else None
            ),
            # the step profile's spans, ms per step over all steps, block warm-ups included
            "step_profile_ms_mean": {path: round(ms, 3) for path, ms in per_step_ms.items()},
            "forward_breakdown_ms_mean": {
                "linears": round(statistics.mean(packed) * 1e3, 2),  # bare passes, qkv included
                "attention_without_qkv": round(attention_s * 1e3, 2),
                # norms, rotary, activations, metadata, transformers' Python
                "rest": round((forward_s - attention_s - statistics.mean(packed)) * 1e3, 2),
            },
            "decode_tokens_per_s": round(batch / step_s, 1),
            "attention_gb_per_s": round(kv_bytes / attention_s / 1e9, 1),
        }
        log(f"limit B={batch}: {row}\nstep profile, B={batch}:\n{profile.report()}")
        results.append(row)
    return {
        "num_prepacked_linears": core.runner.cpu.num_prepacked if core.runner.cpu else 0,
        "memory_read_gb_per_s": round(read_gb_per_s, 1),
        "rows": results,
    }


# ------------------------------------------------------------------------------ HF baselines
def load_hf(core: EngineCore) -> nn.Module:
    """transformers' own model (plain F.linear, its default attention) from the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        core.runner.loaded.source, dtype=core.runner.loaded.dtype, local_files_only=True
    )
    return model.to(core.runner.device).eval()


def hf_generate(
    model: nn.Module, prompts: list[list[int]], max_new: int, pad_id: int
) -> tuple[float, list[int]]:
    """One generate() call over ``prompts`` (left-padded); returns (seconds, tokens per row)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    device = next(model.parameters()).device
    sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=pad_id,
        )
    sync(device)
    elapsed = time.perf_counter() - started
    return elapsed, [out.shape[1] - width] * len(prompts)


def engine_batch(core: EngineCore, prompts: list[list[int]], max_new: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(f"batch-{i}-{started}", prompt, params)
    drain(core)
    return time.perf_counter() - started


def bench_hf(args: argparse.Namespace) -> dict:
    core = make_core(args, max_num_seqs=max(16, args.hf_requests))
    model = load_hf(core)
    pad_id = core.tokenizer.pad_token_id or 0
    rng = random.Random(args.seed + 1)
    prompts = [token_prompt(core, rng, args.hf_prompt_len) for _ in range(args.hf_requests)]
    new = args.hf_output_len
    total = len(prompts) * new

    engine_s = engine_batch(core, prompts, new)
    log(f"hf: engine {engine_s:.1f}s")
    static_s, counts = hf_generate(model, prompts, new, pad_id)
    assert counts == [new] * len(prompts)
    log(f"hf: static batch {static_s:.1f}s")
    sequential_s = 0.0
    seq_prompts = prompts[: args.hf_sequential_requests]
    for prompt in seq_prompts:
        sequential_s += hf_generate(model, [prompt], new, pad_id)[0]
    log(f"hf: sequential {sequential_s:.1f}s for {len(seq_prompts)} requests")
    engine_tps = total / engine_s
    static_tps = total / static_s
    sequential_tps = len(seq_prompts) * new / sequential_s
    return {
        "requests": len(prompts),
        "prompt_tokens": args.hf_prompt_len,
        "output_tokens": new,
        "engine_tokens_per_s": round(engine_tps, 1),
        "hf_static_batch_tokens_per_s": round(static_tps, 1),
        "hf_sequential_tokens_per_s": round(sequential_tps, 1),
        "hf_sequential_requests_measured": len(seq_prompts),
        "engine_over_static_batch": round(engine_tps / static_tps, 2),
        "engine_over_sequential": round(engine_tps / sequential_tps, 2),
    }


# ------------------------------------------------------------------------------ mixed load
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


# ---------------------------------------------------------------------------- prefix cache
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


# ---------------------------------------------------------------------------------- memory
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="model dtype (the issue's figures: float32)")
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
