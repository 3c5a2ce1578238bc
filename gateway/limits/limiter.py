"""The rate limiter: which buckets govern a request (its key's and its model's requests/min and
tokens/min), taken from one store: this process's own (``LocalStore``), or with
``gateway.state`` the one every gateway shares (``SharedLimits``: Redis, behind its on_error
policy). A request is admitted only if every bucket can pay; then all are charged together, so a
refusal costs nothing. Token buckets are charged the prompt estimate up front and corrected by
the upstream's reported usage afterwards (which may leave a bucket in debt, delaying later
requests)."""

from __future__ import annotations

import math

from gateway.config import FleetConfig
from gateway.limits.buckets import Bucket, Store, rate_limit_headers
from gateway.limits.local import LocalStore
from gateway.limits.shared import SharedLimits


class RateLimited(Exception):
    def __init__(self, limit: str, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(limit)
        self.limit = limit  # key_requests | key_tokens | model_requests | model_tokens
        self.retry_after_s = retry_after_s
        self.headers = headers


class LimitGrant:
    """A granted request: its token charge is corrected once the upstream reports usage."""

    __slots__ = ("buckets", "estimate", "headers", "store")

    def __init__(
        self, store: Store, buckets: tuple[Bucket, ...], estimate: int, headers: dict[str, str]
    ) -> None:
        self.store = store
        self.buckets = buckets
        self.estimate = estimate
        self.headers = headers

    def settle(self, actual_tokens: int) -> None:
        if actual_tokens != self.estimate:
            tokens = [bucket for bucket in self.buckets if bucket.counts_tokens]
            if tokens:
                self.store.correct(tokens, actual_tokens - self.estimate)


NO_LIMITS = LimitGrant(LocalStore(), (), 0, {})


class RateLimiter:
    def __init__(self, shared: SharedLimits | None = None) -> None:
        self.shared = shared
        self.local = LocalStore()
        self.keys: dict[str, tuple[Bucket, ...]] = {}
        self.models: dict[str, tuple[Bucket, ...]] = {}
        self._tpm_keys: frozenset[str] = frozenset()
        self._tpm_models: frozenset[str] = frozenset()

    def configure(self, config: FleetConfig) -> None:
        """Applies limits from a (re)loaded config, keeping the state of unchanged buckets."""
        self.keys = {
            key.name: _buckets("key", key.name, key.rpm, key.tpm)
            for key in config.gateway.auth.keys
        }
        self.models = {
            model.name: _buckets("model", model.name, model.limits.rpm, model.limits.tpm)
            for model in config.models
        }
        self._tpm_keys = frozenset(k.name for k in config.gateway.auth.keys if k.tpm is not None)
        self._tpm_models = frozenset(m.name for m in config.models if m.limits.tpm is not None)
        buckets = [b for owner in (*self.keys.values(), *self.models.values()) for b in owner]
        (self.shared or self.local).configure(buckets)

    async def start(self) -> None:
        if self.shared is not None:
            await self.shared.start()

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()

    def needs_estimate(self, key_name: str | None, model: str) -> bool:
        return key_name in self._tpm_keys or model in self._tpm_models

    async def admit(self, key_name: str | None, model: str, estimate: int) -> LimitGrant:
        """Admits one request or raises RateLimited; charges every applicable bucket."""
        buckets = (self.keys.get(key_name, ()) if key_name else ()) + self.models.get(model, ())
        if not buckets:
            return NO_LIMITS
        if self.shared is None:
            taken = self.local.take(buckets, estimate)
        else:
            shared = await self.shared.take(buckets, estimate)
            if shared is None:  # on_error allow, while Redis does not answer
                return NO_LIMITS
            taken = shared
        headers = rate_limit_headers(buckets, taken.levels, taken.store.share)
        if taken.refused >= 0:
            headers["Retry-After"] = str(max(1, math.ceil(taken.wait_s)))
            headers["retry-after-ms"] = str(max(1, math.ceil(taken.wait_s * 1000)))
            raise RateLimited(buckets[taken.refused].limit, taken.wait_s, headers)
        return LimitGrant(taken.store, buckets, estimate, headers)


def _buckets(owner: str, name: str, rpm: int | None, tpm: int | None) -> tuple[Bucket, ...]:
    """A key's or model's buckets: requests and tokens per minute, each where configured."""
    limits = (("requests", rpm, False), ("tokens", tpm, True))
    return tuple(
        Bucket(f"{owner}_{kind}", f"{owner}:{name}:{kind}", per_minute, counts_tokens)
        for kind, per_minute, counts_tokens in limits
        if per_minute is not None
    )
