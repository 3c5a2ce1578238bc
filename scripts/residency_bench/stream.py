"""The seeded request stream: each request's model drawn from a Zipf-like popularity over the
models, whose ranking rotates every ``rotate_every`` requests (yesterday's favourite becomes
today's least wanted), and a short prompt of its own."""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORD_TEXT = (
    "model engine cache block token batch request stream server latency queue memory kernel "
    "attention prefix schedule decode sample output prompt river mountain window garden letter "
    "music winter summer city road forest ocean morning evening story number colour"
)
_WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class StreamRequest:
    index: int
    model: str
    phase: int  # which rotation of the popularity ranking it was drawn under
    prompt: str


def zipf_weights(count: int, skew: float) -> list[float]:
    """Weights 1/rank^skew for ranks 1..count, normalised to sum to 1."""
    if count < 1 or skew < 0:
        raise ValueError("need count >= 1 and skew >= 0")
    raw = [1 / (rank**skew) for rank in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def ranking(models: list[str], phase: int) -> list[str]:
    """The models from most to least popular in ``phase``: the list rotated left by ``phase``."""
    shift = phase % len(models)
    return models[shift:] + models[:shift]


def build_stream(
    models: list[str], count: int, seed: int, skew: float, rotate_every: int
) -> list[StreamRequest]:
    """``count`` requests; the same arguments give the same stream."""
    if rotate_every < 1:
        raise ValueError("rotate_every must be >= 1")
    rng = random.Random(seed)
    weights = zipf_weights(len(models), skew)
    stream = []
    for index in range(count):
        phase = index // rotate_every
        model = rng.choices(ranking(models, phase), weights)[0]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
        stream.append(StreamRequest(index, model, phase, f"Request {index}: {words}."))
    return stream


def warm_up_order(models: list[str], park: bool) -> list[str]:
    """What a swapping policy loads before the stream, so that the stream opens with its first
    phase's two favourites awake: least popular first, the favourite last (with a budget of two,
    the least popular is then evicted). With parking, twice round: every model has then been
    parked once (a first park saves the weights, later ones only drop them), and the least
    popular ends parked rather than stopped."""
    order = list(reversed(ranking(models, 0)))
    return order * 2 if park else order
