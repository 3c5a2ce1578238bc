"""Baselines on the same prompts, in this process: the engine driven offline (what HTTP costs) and
transformers generate() with static batches. Both load torch, so they import it only when run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from scripts.serving.results import RequestResult, report
from scripts.serving.workload import RequestSpec

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore


def run_offline(
    engine_args: list[str],
    specs: list[RequestSpec],
    concurrency: int,
    max_seconds: float,
    core: EngineCore | None = None,
) -> tuple[dict, EngineCore]:
    """The engine's own throughput without HTTP: EngineCore driven in this process, closed loop
    with ``concurrency`` requests in flight, the same prompts and output lengths."""
    from engine.core.engine_core import EngineCore
    from engine.core.sampling_params import SamplingParams
    from engine.errors import InvalidRequestError
    from engine.serving.cli import parse_args

    if core is None:
        config, _ = parse_args(engine_args)
        core = EngineCore(config)
    queue = list(reversed(specs))
    in_flight: dict[str, RequestResult] = {}
    results: list[RequestResult] = []
    counter = 0
    started = time.perf_counter()
    deadline = started + max_seconds
    while (queue or in_flight) and time.perf_counter() < deadline:
        while queue and len(in_flight) < concurrency:
            spec = queue.pop()
            request_id = f"offline-{counter}"
            counter += 1
            ids = list(core.tokenizer(spec.prompt)["input_ids"])
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
            result = RequestResult(ok=False, start=time.perf_counter(), prompt_tokens=len(ids))
            results.append(result)
            try:
                core.add_request(request_id, ids, params)
            except InvalidRequestError as error:  # what the server answers with a 400
                result.error = error.message
                continue
            in_flight[request_id] = result
        for out in core.step():
            now = time.perf_counter()
            result = in_flight[out.request_id]
            result.output_tokens += sum(len(c.token_ids) for c in out.outputs)
            if result.ttft is None:
                result.ttft = now - result.start
            if out.finished:
                result.ok, result.end = True, now
                del in_flight[out.request_id]
    for request_id in in_flight:  # cut by the time bound: their tokens so far still count
        core.abort(request_id)
    duration = time.perf_counter() - started
    extra = {
        "mode": "offline-engine",
        "concurrency": concurrency,
        "cut_at_deadline": len(in_flight),
    }
    return report(results, duration, extra), core


def hf_model(engine_args: list[str]) -> tuple[Path, str]:
    """The engine's model as transformers loads it: folder (a GGUF's converted copy) and dtype."""
    from engine.model.loader import converted_gguf_dir, resolve_device, resolve_dtype, split_source
    from engine.serving.cli import parse_args

    config, _ = parse_args(engine_args)
    path, gguf = split_source(config.model, config.gguf_file)
    dtype = resolve_dtype(config.dtype, resolve_device(config.device))
    return (converted_gguf_dir(path / gguf) if gguf else path), str(dtype).removeprefix("torch.")


def run_hf_static(
    model: tuple[Path, str], specs: list[RequestSpec], batch: int, max_seconds: float
) -> dict:
    """transformers generate() with static batches of ``batch`` prompts, one after another (left
    padded, greedy). A static batch runs until its longest request is done, so only the tokens
    each request asked for count as output (the rest is static batching's waste)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, dtype = model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():  # warm-up: first calls pay one-off allocation costs
        warm = tokenizer(["warm up"], return_tensors="pt")
        hf.generate(**warm, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    results: list[RequestResult] = []
    started = time.perf_counter()
    deadline = started + max_seconds
    for i in range(0, len(specs), batch):
        group = specs[i : i + batch]
        if time.perf_counter() >= deadline:
            break
        new_tokens = max(s.max_tokens for s in group)
        inputs = tokenizer([s.prompt for s in group], return_tensors="pt", padding=True)
        begin = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        end = time.perf_counter()
        for spec, mask in zip(group, inputs["attention_mask"], strict=True):
            results.append(
                RequestResult(
                    ok=True,
                    start=begin,
                    end=end,
                    ttft=None,
                    prompt_tokens=int(mask.sum()),
                    output_tokens=spec.max_tokens,
                )
            )
    duration = time.perf_counter() - started
    return report(results, duration, {"mode": "hf-static-batch", "batch": batch, "dtype": dtype})
