"""What every store shares: a configured limit (``Bucket``), what taking from a set of them gave
(``Taken``), the in-process token bucket, and the x-ratelimit-* headers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(frozen=True, slots=True)
class Bucket:
    """One configured limit of one key or model: the store's name for it and its allowance."""

    limit: str  # key_requests | key_tokens | model_requests | model_tokens (the metrics' label)
    id: str  # unique among buckets: "key:team-a:requests"
    per_minute: int
    counts_tokens: bool  # charged the prompt estimate (corrected later), else 1 per request


class Store(Protocol):
    # Every allowance is split into this many parts: 1, or the gateways sharing it for the
    # in-process fallback of on_error local.
    share: int

    def correct(self, buckets: Sequence[Bucket], delta: int) -> None:
        """Charges ``delta`` more tokens (a refund when negative) to each of ``buckets``."""


class Taken(NamedTuple):
    """What a store answered: ``refused``, the index of the bucket that refused (the one with the
    longest wait) or -1 when every one was charged; ``levels``, each bucket's tokens then."""

    refused: int
    wait_s: float
    levels: Sequence[float]
    store: Store  # where the grant's usage correction goes


class TokenBucket:
    """A bucket in this process: holds up to one minute's allowance, refills continuously."""

    __slots__ = ("capacity", "rate", "tokens", "updated")

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.tokens = self.capacity
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` can be paid (0 if now); amounts above capacity need a full
        bucket, so one oversized request cannot be refused forever."""
        need = min(amount, self.capacity)
        return 0.0 if self.tokens >= need else (need - self.tokens) / self.rate

    def resize(self, per_minute: float, now: float) -> None:
        self.refill(now)
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.tokens = min(self.tokens, self.capacity)


def rate_limit_headers(
    buckets: Sequence[Bucket], levels: Sequence[float], share: int
) -> dict[str, str]:
    """OpenAI-style x-ratelimit-* headers from the tightest requests and tokens buckets (the
    fullest share of its capacity spent); a bucket refills its capacity in one minute."""
    tightest: dict[str, tuple[float, float, float]] = {}
    for bucket, level in zip(buckets, levels, strict=True):
        capacity = bucket.per_minute / share
        fill = level / capacity
        kind = "tokens" if bucket.counts_tokens else "requests"
        if kind not in tightest or fill < tightest[kind][0]:
            tightest[kind] = (fill, capacity, level)
    headers: dict[str, str] = {}
    for kind, (fill, capacity, level) in tightest.items():
        headers[f"x-ratelimit-limit-{kind}"] = str(int(capacity))
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(level)))
        headers[f"x-ratelimit-reset-{kind}"] = f"{max(0.0, 60.0 * (1.0 - fill)):.3f}s"
    return headers
