"""The retry budget: a share of requests plus a reserve, never banked beyond its cap."""

from __future__ import annotations

from gateway.config import RetrySettings
from gateway.proxy.budget import RetryBudget


def test_retry_budget_is_bounded():
    budget = RetryBudget(RetrySettings(budget_percent=20, budget_min=0))
    budget.balance = 0
    for _ in range(50):
        budget.deposit()
    assert sum(budget.try_spend() for _ in range(100)) in (9, 10)  # 20 % of 50 (float sums)
    for _ in range(10_000):  # a long healthy spell banks at most the cap
        budget.deposit()
    assert sum(budget.try_spend() for _ in range(1000)) <= budget.cap
