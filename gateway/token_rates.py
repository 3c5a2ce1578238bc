"""Completion tokens per model over the last minute, for ``GET /admin/models`` and ``modelyard
ps``: one-second buckets in a rolling window, fed with each answer's usage as it ends. A request
counts when it finishes (its usage comes last), so a long stream shows up at its end; the rate is
the window's tokens over the whole window, so it ramps up over the first minute of load."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 60


class TokenRates:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # model -> [second, tokens] buckets, oldest first; at most WINDOW_S of them per model
        self._buckets: dict[str, deque[list[int]]] = {}

    def add(self, model: str, tokens: int) -> None:
        now = int(self._clock())
        buckets = self._buckets.setdefault(model, deque())
        if buckets and buckets[-1][0] == now:
            buckets[-1][1] += tokens
        else:
            buckets.append([now, tokens])
        _expire(buckets, now)

    def per_second(self, model: str) -> float:
        """``model``'s completion tokens per second over the last ``WINDOW_S`` seconds."""
        buckets = self._buckets.get(model)
        if not buckets:
            return 0.0
        _expire(buckets, int(self._clock()))
        return sum(tokens for _, tokens in buckets) / WINDOW_S


def _expire(buckets: deque[list[int]], now: int) -> None:
    while buckets and buckets[0][0] <= now - WINDOW_S:
        buckets.popleft()
