"""Section ``hf``: the engine vs transformers generate(), sequential and as one static padded
batch, on the same prompts; and the generate() helpers the ``mixed`` section shares."""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch import nn

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from scripts.engine_bench.shared import drain, log, make_core, sync, token_prompt


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
