"""The in-process store: this gateway's own token buckets. The store without ``gateway.state``,
and, at 1/gateways of every allowance, the fallback of ``on_error: local`` while Redis is down."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from gateway.limits.buckets import Bucket, Taken, TokenBucket


class LocalStore:
    def __init__(self, share: int = 1) -> None:
        self.share = share
        self.buckets: dict[str, TokenBucket] = {}

    def configure(self, buckets: Iterable[Bucket]) -> None:
        """The buckets of a (re)loaded config; unchanged ones keep their tokens."""
        now = time.monotonic()
        kept: dict[str, TokenBucket] = {}
        for bucket in buckets:
            per_minute = bucket.per_minute / self.share
            state = self.buckets.get(bucket.id)
            if state is None:
                state = TokenBucket(per_minute, now)
            else:
                state.resize(per_minute, now)
            kept[bucket.id] = state
        self.buckets = kept

    def take(self, buckets: Sequence[Bucket], estimate: int) -> Taken:
        """Refills and checks every bucket; charges all of them, or none if one must wait."""
        now = time.monotonic()
        states = [self.buckets[bucket.id] for bucket in buckets]
        refused, longest = -1, 0.0
        for i, state in enumerate(states):
            state.refill(now)
            wait = state.wait_s(estimate if buckets[i].counts_tokens else 1)
            if wait > longest:
                refused, longest = i, wait
        if refused < 0:
            for bucket, state in zip(buckets, states, strict=True):
                state.tokens -= estimate if bucket.counts_tokens else 1
        return Taken(refused, longest, [state.tokens for state in states], self)

    def correct(self, buckets: Sequence[Bucket], delta: int) -> None:
        now = time.monotonic()
        for bucket in buckets:
            state = self.buckets.get(bucket.id)  # gone if a reload removed its limit
            if state is not None:
                state.refill(now)
                state.tokens = min(state.capacity, state.tokens - delta)
