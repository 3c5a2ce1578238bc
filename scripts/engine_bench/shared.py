"""What every section uses: an EngineCore from the command line's settings, prompts of an exact
token length, device syncs, running a core dry, and the progress log."""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore

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
        "quantization": args.quantization,
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
