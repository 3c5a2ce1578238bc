"""scripts/bench_fairness.py's arithmetic on access-log entries: generated tokens spread over each
request's time in its slot, service shares, waits of the requests that came in the window, and
the ratios between policies."""

from __future__ import annotations

from scripts.bench_fairness import TENANTS, ratios, summarize


def entry(key: str, end: float, held_s: float, completion: int, wait_ms: float = 0.0) -> dict:
    return {
        "key": key,
        "ts": end,
        "latency_ms": held_s * 1000 + wait_ms,
        "queue_wait_ms": wait_ms,
        "prompt_tokens": 3,
        "completion_tokens": completion,
    }


def test_tokens_are_spread_over_each_requests_time_in_its_slot():
    t1 = 100.0
    entries = [
        entry("long", end=t1 + 1.5, held_s=1.0, completion=96),  # half in second 0, half in 1
        entry("short", end=t1 + 0.5, held_s=1.0, completion=8, wait_ms=40),  # half before t1
        entry("heavy", end=t1 + 2.5, held_s=0.5, completion=32, wait_ms=10),
    ]
    out = summarize(entries, t1, seconds=3)
    tenants = out["tenants"]
    assert tenants["long"]["tokens_per_s"] == [48.0, 48.0, 0.0]
    assert tenants["short"]["tokens_per_s"] == [4.0, 0.0, 0.0]
    assert tenants["heavy"]["tokens_per_s"] == [0.0, 0.0, 32.0]
    assert out["generated_tokens_per_s"] == round((96 + 4 + 32) / 3, 1)
    # the short request was admitted before the window: its prompt is not the window's
    assert [tenants[t]["service_tokens"] for t in TENANTS] == [99, 4, 35]
    assert tenants["short"]["requests"] == 0 and tenants["heavy"]["queue_wait_p99_ms"] == 10
    assert tenants["heavy"]["weight_share"] == 0.5


def test_ratios_compare_shares_to_weights_and_fcfs_waits_to_fair_ones():
    def result(shares: dict[str, float], p99: dict[str, float]) -> dict:
        return {"tenants": {t: {"service_share": shares[t], "weight_share": w / 4,
                                "queue_wait_p99_ms": p99[t]}
                            for t, (w, _, _) in TENANTS.items()}}  # fmt: skip

    fair = result({"long": 0.25, "short": 0.2, "heavy": 0.55}, {"long": 900, "short": 50,
                                                               "heavy": 100})  # fmt: skip
    fcfs = result({"long": 0.75, "short": 0.05, "heavy": 0.2}, {"long": 300, "short": 400,
                                                               "heavy": 300})  # fmt: skip
    out = ratios({"fair": fair, "fcfs": fcfs})
    assert out["long"] == {"fair_share_over_weight": 1.0, "fcfs_share_over_weight": 3.0,
                           "p99_wait_fcfs_over_fair": 0.33}  # fmt: skip
    assert out["short"]["p99_wait_fcfs_over_fair"] == 8.0
    assert out["heavy"]["fair_share_over_weight"] == 1.1
