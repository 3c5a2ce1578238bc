"""Token buckets for requests/min and tokens/min per API key and per model, and per-model
concurrency caps.

A bucket holds up to one minute's allowance and refills continuously. A request is admitted only if
every bucket that applies to it can pay; then all of them are charged together, so a refused request
costs nothing. Token buckets are charged the prompt estimate up front and corrected by the
upstream's reported usage afterwards (which may leave a bucket in debt, delaying later requests).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from gateway.config import FleetConfig


class TokenBucket:
    __slots__ = ("capacity", "rate", "tokens", "updated")

    def __init__(self, per_minute: int, now: float) -> None:
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

    def reset_s(self) -> float:
        return max(0.0, (self.capacity - self.tokens) / self.rate)

    def resize(self, per_minute: int, now: float) -> None:
        self.refill(now)
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.tokens = min(self.tokens, self.capacity)


@dataclass
class Limits:
    """The buckets that govern one key or one model; None where no limit is configured."""

    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None


class RateLimited(Exception):
    def __init__(self, limit: str, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(limit)
        self.limit = (
            limit  # key_requests | key_tokens | model_requests | model_tokens | concurrency
        )
        self.retry_after_s = retry_after_s
        self.headers = headers


class Admission:
    """A granted request: correct its token charge once usage is known, release at the end."""

    __slots__ = ("estimate", "headers", "token_buckets")

    def __init__(
        self, token_buckets: tuple[TokenBucket, ...], estimate: int, headers: dict[str, str]
    ) -> None:
        self.token_buckets = token_buckets
        self.estimate = estimate
        self.headers = headers

    def settle(self, actual_tokens: int) -> None:
        if not self.token_buckets:
            return
        delta = actual_tokens - self.estimate
        now = time.monotonic()
        for bucket in self.token_buckets:
            bucket.refill(now)
            bucket.tokens = min(bucket.capacity, bucket.tokens - delta)


NO_LIMITS = Admission((), 0, {})


class RateLimiter:
    def __init__(self) -> None:
        self.keys: dict[str, Limits] = {}
        self.models: dict[str, Limits] = {}

    def configure(self, config: FleetConfig) -> None:
        """Applies limits from a (re)loaded config, keeping the state of unchanged buckets."""
        now = time.monotonic()
        self.keys = {
            key.name: _limits(self.keys.get(key.name), key.rpm, key.tpm, now)
            for key in config.gateway.auth.keys
        }
        self.models = {
            model.name: _limits(
                self.models.get(model.name), model.limits.rpm, model.limits.tpm, now
            )
            for model in config.models
        }

    def needs_estimate(self, key_name: str | None, model: str) -> bool:
        key = self.keys.get(key_name) if key_name else None
        model_limits = self.models.get(model)
        return bool((key and key.tokens) or (model_limits and model_limits.tokens))

    def admit(self, key_name: str | None, model: str, estimate: int) -> Admission:
        """Admits one request or raises RateLimited; charges every applicable bucket."""
        key = self.keys.get(key_name) if key_name else None
        model_limits = self.models.get(model)
        checks: list[tuple[str, TokenBucket, float]] = []
        if key is not None:
            if key.requests:
                checks.append(("key_requests", key.requests, 1))
            if key.tokens:
                checks.append(("key_tokens", key.tokens, estimate))
        if model_limits is not None:
            if model_limits.requests:
                checks.append(("model_requests", model_limits.requests, 1))
            if model_limits.tokens:
                checks.append(("model_tokens", model_limits.tokens, estimate))
        if not checks:
            return NO_LIMITS
        now = time.monotonic()
        refused: tuple[str, float] | None = None
        for name, bucket, amount in checks:
            bucket.refill(now)
            wait = bucket.wait_s(amount)
            if wait > 0 and (refused is None or wait > refused[1]):
                refused = (name, wait)
        if refused is not None:
            headers = _headers(checks)
            headers["Retry-After"] = str(max(1, math.ceil(refused[1])))
            headers["retry-after-ms"] = str(max(1, math.ceil(refused[1] * 1000)))
            raise RateLimited(refused[0], refused[1], headers)
        for _, bucket, amount in checks:
            bucket.tokens -= amount
        token_buckets = tuple(b for name, b, _ in checks if name.endswith("tokens"))
        return Admission(token_buckets, estimate, _headers(checks))


def _limits(old: Limits | None, rpm: int | None, tpm: int | None, now: float) -> Limits:
    return Limits(
        requests=_bucket(old.requests if old else None, rpm, now),
        tokens=_bucket(old.tokens if old else None, tpm, now),
    )


def _bucket(old: TokenBucket | None, per_minute: int | None, now: float) -> TokenBucket | None:
    if per_minute is None:
        return None
    if old is None:
        return TokenBucket(per_minute, now)
    old.resize(per_minute, now)
    return old


def _headers(checks: list[tuple[str, TokenBucket, float]]) -> dict[str, str]:
    """OpenAI-style x-ratelimit-* headers from the tightest requests and tokens buckets."""
    headers: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        buckets = [b for name, b, _ in checks if name.endswith(kind)]
        if not buckets:
            continue
        tightest = min(buckets, key=lambda b: b.tokens / b.capacity)
        headers[f"x-ratelimit-limit-{kind}"] = str(int(tightest.capacity))
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(tightest.tokens)))
        headers[f"x-ratelimit-reset-{kind}"] = f"{tightest.reset_s():.3f}s"
    return headers
