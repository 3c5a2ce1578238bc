"""The seeded workload: prompts of mixed lengths from a fixed word list, and output lengths."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her they this which be have "
    "are were had not but their there been one all would when will more no who so if out about "
    "up what some into them can only other new time could these two may first then do any like "
    "my now over such our man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since "
    "against go came right used take three model engine cache block token batch request stream "
    "server latency queue memory kernel attention prefix schedule decode sample output prompt"
)
_WORDS = _WORD_TEXT.split()


# ---- workload --------------------------------------------------------------------------------


@dataclass
class RequestSpec:
    prompt: str
    max_tokens: int


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: expected N or MIN:MAX, 0 < MIN")
    return lo, hi


def build_workload(
    count: int, seed: int, input_words: tuple[int, int], output_len: tuple[int, int]
) -> list[RequestSpec]:
    """Seeded prompts of mixed lengths (uniform word counts) and output lengths."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(*input_words))]
        prompt = f"Request {i}: " + " ".join(words)
        specs.append(RequestSpec(prompt, rng.randint(*output_len)))
    return specs


def tagged(specs: list[RequestSpec], tag: str) -> list[RequestSpec]:
    """The workload with every prompt opened by a run's own tag: runs against one server must not
    reuse each other's prompts from its prefix cache (same lengths, no shared first block)."""
    return [RequestSpec(f"[{tag}] {spec.prompt}", spec.max_tokens) for spec in specs]
