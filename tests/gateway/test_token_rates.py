"""The completion tokens per second over the last minute that /admin/models reports per model."""

from __future__ import annotations

from gateway.token_rates import WINDOW_S, TokenRates


def test_tokens_count_for_a_minute_then_leave_the_window():
    now = [1000.0]
    rates = TokenRates(clock=lambda: now[0])
    assert rates.per_second("m") == 0.0
    rates.add("m", 30)
    now[0] += 0.5
    rates.add("m", 30)  # the same second's bucket
    now[0] += 30
    rates.add("m", 60)
    rates.add("other", 6)
    assert rates.per_second("m") == 120 / WINDOW_S
    assert rates.per_second("other") == 6 / WINDOW_S
    now[0] += WINDOW_S - 30  # the first two answers are a minute old
    assert rates.per_second("m") == 60 / WINDOW_S
    now[0] += 30
    assert rates.per_second("m") == 0.0
