"""Section ``limit``: the bare linears at batch B vs the engine's whole decode step at B, the step
broken into the step profile's spans, and the K/V bytes attention reads per step against a plain
read of memory, sequential and through the block tables."""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.model.cpu.kernels.build import available
from engine.model.cpu.kernels.paged_decode import read_paged_kv
from engine.model.cpu.linear import PrepackedLinear, StepGemms
from engine.model.cpu.quant_linear import QuantizedLinear
from engine.model.step_profile import ATTENTION, FORWARD, StepProfile
from scripts.engine_bench.shared import log, make_core, sync, token_prompt


def model_linears(core: EngineCore) -> list[nn.Module]:
    """The engine's linear modules in execution order (prepacked or narrow-weight on CPU,
    nn.Linear on CUDA)."""
    kinds = (PrepackedLinear, QuantizedLinear, nn.Linear)
    return [m for m in core.runner.model.modules() if isinstance(m, kinds)]


def weight_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of weights one pass over ``module`` reads: a narrow weight's packed records, else
    its [out, in] matrix in the model's ``dtype`` (one of a prepacked linear's layouts)."""
    if isinstance(module, QuantizedLinear):
        return module.packed.numel() * module.packed.element_size()
    return module.out_features * module.in_features * dtype.itemsize


def linear_pass(
    core: EngineCore, modules: list[nn.Module], batch: int, packed: bool
) -> Callable[[], float]:
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
    # the step's weights read once at that speed: the floor of a memory-bound step (at B=1 the
    # bare linear calls land above the step, whose one C call beats calling them one by one)
    weights_floor_s = sum(weight_bytes(m, core.runner.loaded.dtype) for m in linears) / (
        read_gb_per_s * 1e9
    )
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
            "weights_read_floor_ms": round(weights_floor_s * 1e3, 2),
            "step_over_weights_floor": round(step_s / weights_floor_s, 3),
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
