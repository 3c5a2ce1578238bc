"""The retry budget: retries may add about ``budget_percent`` of requests plus ``budget_min`` per
second, so a quiet gateway can still retry while a failing fleet is not hammered."""

from __future__ import annotations

import time

from gateway.config import RetrySettings


class RetryBudget:
    """Retries earn ``percent``% of a token per request, plus ``minimum`` tokens per second; a retry
    spends one. Bounded, so a long healthy spell cannot bank a retry storm."""

    def __init__(self, settings: RetrySettings) -> None:
        self.ratio = settings.budget_percent / 100
        self.per_second = float(settings.budget_min)
        self.cap = 2 * settings.budget_min + 100 * self.ratio
        self.balance = self.cap
        self.updated = time.monotonic()

    def deposit(self) -> None:
        self.balance = min(self.cap, self.balance + self.ratio)

    def try_spend(self) -> bool:
        now = time.monotonic()
        self.balance = min(self.cap, self.balance + (now - self.updated) * self.per_second)
        self.updated = now
        if self.balance >= 1:
            self.balance -= 1
            return True
        return False
