"""How fast a model's line drains: its completions per second while it has work, smoothed, and
what that makes of the wait ahead of a request (its expected wait, a refusal's Retry-After)."""

from __future__ import annotations

import math

SMOOTHING = 0.2  # weight of the newest interval between completions
UNMEASURED_RETRY_AFTER_S = 5  # before the first measurement (and while a model loads)


class DrainRate:
    """The mean interval between completions, exponentially smoothed. Only busy time counts: the
    first completion after an idle spell is timed from the request that ended it."""

    __slots__ = ("_interval", "_last")

    def __init__(self) -> None:
        self._interval: float | None = None
        self._last: float | None = None  # the last completion, or the start of busy time

    def started(self, now: float) -> None:
        """A request was admitted; from idle, busy time starts now."""
        if self._last is None:
            self._last = now

    def completed(self, now: float, idle: bool) -> None:
        """A request ended; ``idle``: none is left in flight."""
        if self._last is not None:
            interval = now - self._last
            previous = self._interval
            self._interval = (
                interval if previous is None else previous + SMOOTHING * (interval - previous)
            )
        self._last = None if idle else now

    @property
    def per_s(self) -> float | None:
        """Completions per second; None before the first was measured."""
        if self._interval is None:
            return None
        return 1.0 / max(self._interval, 1e-6)

    def wait_s(self, ahead: int) -> float | None:
        """The expected wait of a request with ``ahead`` requests to go before it: until
        ``ahead + 1`` completions have freed it a slot; None while unmeasured."""
        rate = self.per_s
        return None if rate is None else (ahead + 1) / rate

    def retry_after_s(self, ahead: int) -> int:
        """A refusal's Retry-After: whole seconds, at least 1."""
        wait = self.wait_s(ahead)
        return UNMEASURED_RETRY_AFTER_S if wait is None else max(1, math.ceil(wait))
