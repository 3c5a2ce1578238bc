"""scripts/bench_residency.py's pure parts: the seeded request stream and the summary maths."""

from __future__ import annotations

import pytest

from scripts.residency_bench.stream import (
    build_stream,
    ranking,
    warm_up_order,
    zipf_weights,
)
from scripts.residency_bench.summary import (
    DEFAULT_PARKED_FLOOR,
    RequestRecord,
    anomalies,
    choose_budget,
    memory_use,
    parse_metrics,
    ratios,
    summarize,
    swaps,
)

MODELS = ["a", "b", "c"]
GiB = 2**30


# ---- the stream ----


def test_zipf_weights_are_normalised_and_decreasing() -> None:
    weights = zipf_weights(3, 2.0)
    assert sum(weights) == pytest.approx(1.0)
    assert weights == sorted(weights, reverse=True)
    assert weights[0] / weights[1] == pytest.approx(4.0)  # (2/1)^2
    assert zipf_weights(3, 0.0) == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError):
        zipf_weights(0, 1.0)


def test_ranking_rotates_every_phase() -> None:
    assert ranking(MODELS, 0) == ["a", "b", "c"]
    assert ranking(MODELS, 1) == ["b", "c", "a"]
    assert ranking(MODELS, 2) == ["c", "a", "b"]
    assert ranking(MODELS, 3) == ranking(MODELS, 0)


def test_stream_is_seeded() -> None:
    one = build_stream(MODELS, 50, seed=7, skew=1.5, rotate_every=10)
    assert one == build_stream(MODELS, 50, seed=7, skew=1.5, rotate_every=10)
    assert one != build_stream(MODELS, 50, seed=8, skew=1.5, rotate_every=10)
    assert [r.index for r in one] == list(range(50))
    assert [r.phase for r in one] == [i // 10 for i in range(50)]
    assert len({r.prompt for r in one}) == 50  # no two requests share a prompt


def test_stream_follows_the_rotating_favourite() -> None:
    stream = build_stream(MODELS, 3000, seed=0, skew=3.0, rotate_every=1000)
    for phase in range(3):
        drawn = [r.model for r in stream if r.phase == phase]
        favourite = ranking(MODELS, phase)[0]
        # weight of rank 1 at skew 3: 1 / (1 + 1/8 + 1/27) ≈ 0.86
        assert drawn.count(favourite) / len(drawn) == pytest.approx(0.86, abs=0.04)


def test_warm_up_ends_with_the_first_favourites_loaded_last() -> None:
    assert warm_up_order(MODELS, park=False) == ["c", "b", "a"]
    assert warm_up_order(MODELS, park=True) == ["c", "b", "a", "c", "b", "a"]


# ---- request summaries ----


def _record(
    index: int, model: str, latency: float, ttft: float, status: int = 200
) -> RequestRecord:
    return RequestRecord(index, model, 0, 0.0, latency, ttft, status, 8, None)


def test_summarize_counts_errors_apart_and_uses_percentiles() -> None:
    records = [_record(i, "a", latency=float(i + 1), ttft=0.1 * (i + 1)) for i in range(10)]
    records.append(RequestRecord(10, "b", 1, 0.0, 0.5, None, 503, 0, "loading"))
    out = summarize(records, duration_s=20.0)
    assert out["requests"] == 11 and out["completed"] == 10 and out["errors"] == 1
    assert out["requests_per_s"] == pytest.approx(0.5)
    assert out["latency_s"]["p50"] == pytest.approx(5.5)
    assert out["latency_s"]["p99"] == pytest.approx(9.91)  # rank 8.91 between 9 and 10
    assert out["latency_s"]["max"] == 10.0
    assert out["ttft_s"]["p50"] == pytest.approx(0.55)
    assert out["per_model"]["b"] == {
        "requests": 1,
        "errors": 1,
        "latency_s": {"p50": None, "p99": None, "mean": None, "max": None},
        "ttft_s": {"p50": None, "p99": None, "mean": None, "max": None},
    }
    assert out["error_samples"] == ["503: loading"]


def test_a_200_with_an_error_in_the_stream_is_an_error() -> None:
    record = RequestRecord(0, "a", 0, 0.0, 1.0, None, 200, 0, "no tokens received")
    assert not record.ok
    assert summarize([record], 1.0)["errors"] == 1


# ---- the gateway's metrics ----

_BEFORE = """\
# TYPE modelyard_model_evictions_total counter
modelyard_model_evictions_total{action="park",model="a",reason="memory"} 1.0
modelyard_model_evictions_total{action="stop",model="b",reason="memory"} 0.0
# TYPE modelyard_model_load_seconds histogram
modelyard_model_load_seconds_count{kind="cold",model="a"} 1.0
modelyard_model_load_seconds_sum{kind="cold",model="a"} 10.0
"""
_AFTER = """\
# TYPE modelyard_model_evictions_total counter
modelyard_model_evictions_total{action="park",model="a",reason="memory"} 3.0
modelyard_model_evictions_total{action="stop",model="b",reason="memory"} 2.0
modelyard_model_evictions_total{action="park",model="c",reason="operator"} 1.0
# TYPE modelyard_model_load_seconds histogram
modelyard_model_load_seconds_count{kind="cold",model="a"} 2.0
modelyard_model_load_seconds_sum{kind="cold",model="a"} 22.5
modelyard_model_load_seconds_count{kind="wake",model="c"} 4.0
modelyard_model_load_seconds_sum{kind="wake",model="c"} 2.0
# TYPE modelyard_admission_wait_seconds histogram
modelyard_admission_wait_seconds_bucket{key="_anonymous",le="0.0",model="c"} 2.0
modelyard_admission_wait_seconds_bucket{key="_anonymous",le="0.001",model="c"} 2.0
modelyard_admission_wait_seconds_count{key="_anonymous",model="c"} 5.0
modelyard_admission_wait_seconds_sum{key="_anonymous",model="c"} 1.5
"""


def test_swaps_are_deltas_between_scrapes() -> None:
    out = swaps(parse_metrics(_BEFORE), parse_metrics(_AFTER))
    assert out["evictions"] == 5
    assert out["evictions_by_action"] == {"park": 3, "stop": 2}
    assert out["evictions_by_model_action_reason"] == {
        "a/park/memory": 2,
        "b/stop/memory": 2,
        "c/park/operator": 1,
    }
    assert out["loads_by_kind"] == {"cold": 1, "wake": 4}
    assert out["load_seconds_sum_by_kind"] == {"cold": 12.5, "wake": 2.0}
    assert out["held_requests"] == 3 and out["held_seconds_sum"] == 1.5


def test_no_change_is_no_swaps() -> None:
    same = parse_metrics(_AFTER)
    out = swaps(same, same)
    assert out["evictions"] == 0 and out["loads_by_kind"] == {} and out["held_requests"] == 0


def test_memory_use_over_a_timeline() -> None:
    timeline = [
        {
            "resident_bytes": 5,
            "engine_rss_bytes": 4,
            "engine_pss_bytes": 3,
            "models": {"a": ["ready"], "b": ["parked"]},
        },
        {
            "resident_bytes": 9,
            "engine_rss_bytes": 11,
            "engine_pss_bytes": 7,
            "models": {"a": ["ready"], "b": ["waking"]},
        },
    ]
    out = memory_use(timeline, budget=8)
    assert out["max_resident_bytes"] == 9 and out["samples_over_budget"] == 1
    assert out["max_engine_rss_bytes"] == 11 and out["samples_engine_rss_over_budget"] == 1
    assert out["max_engine_pss_bytes"] == 7 and out["samples_engine_pss_over_budget"] == 0
    assert out["max_models_awake"] == 2 and out["samples_three_awake"] == 0
    assert memory_use([], 8)["max_resident_bytes"] is None


# ---- the budget ----


def test_budget_is_two_largest_awake_plus_smallest_parked_floor_plus_margin() -> None:
    awake = {"a": 2 * GiB, "b": 2 * GiB, "c": 5 * GiB}
    out = choose_budget(awake, {}, {"a": GiB // 2, "c": GiB}, margin=0.05)
    assert out["two_largest_awake_bytes"] == 7 * GiB
    assert out["parked_floor_bytes"] == GiB // 2
    assert out["cpu_bytes"] == int(7.5 * GiB * 1.05)
    assert out["adjusted"] is None and not out["holds_three_awake"]


def test_budget_counts_the_growth_reserved_once() -> None:
    awake = {"a": 2 * GiB, "b": 2 * GiB, "c": 5 * GiB}
    out = choose_budget(awake, {}, {"a": GiB // 2}, margin=0.0, growth=GiB)
    assert out["cpu_bytes"] == int(8.5 * GiB) and out["growth_bytes"] == GiB
    assert out["three_awake_smallest_bytes"] == 10 * GiB  # the three awake, and the growth


def test_budget_without_a_measured_parked_floor_uses_the_default() -> None:
    out = choose_budget({"a": 2 * GiB, "b": 2 * GiB, "c": 5 * GiB}, {}, {})
    assert out["parked_floor_bytes"] == DEFAULT_PARKED_FLOOR
    assert out["parked_floor_source"].startswith("default")


def test_budget_that_would_hold_all_three_goes_halfway() -> None:
    awake = {"a": 2 * GiB, "b": 2 * GiB, "c": 5 * GiB}
    low = {"a": int(1.7 * GiB), "b": int(1.7 * GiB), "c": int(4.4 * GiB)}  # 7.8 GiB together
    out = choose_budget(awake, low, {"a": GiB // 2}, margin=0.05)
    assert out["formula_bytes"] >= out["three_awake_smallest_bytes"]
    assert out["cpu_bytes"] == (int(7.5 * GiB) + out["three_awake_smallest_bytes"]) // 2
    assert not out["holds_three_awake"] and out["adjusted"]


def test_budget_needs_three_models() -> None:
    with pytest.raises(ValueError):
        choose_budget({"a": 1, "b": 1}, {}, {})


# ---- ratios ----


def _policy(p99: float) -> dict:
    return {"latency_s": {"p99": p99}}


def test_ratios_and_goals() -> None:
    policies = {
        "all_resident": _policy(1.0),
        "cold_swap": _policy(30.0),
        "park_wake": _policy(1.5),
    }
    timings = {
        "a": {
            "wake": {"ttft_s": 0.8, "gateway_load_s": 0.6},
            "cold": {"ttft_s": 16.0, "gateway_load_s": 12.0},
        },
        "c": {"wake": {"ttft_s": 1.4}, "cold": {"ttft_s": 30.0}},
    }
    out = ratios(policies, timings, "a")
    assert out["park_wake_p99_over_all_resident_p99"] == 1.5
    assert out["cold_swap_p99_over_park_wake_p99"] == 20.0
    assert out["a_wake_ttft_over_cold_ttft"] == 0.05
    assert out["a_wake_load_s_over_cold_load_s"] == 0.05
    goals = out["goals_met"]
    assert goals["park_wake_p99_over_all_resident_p99 <= 2"]
    assert goals["cold_swap_p99_over_park_wake_p99 >= 3"]
    assert goals["wake_ttft <= 1 s"] == {"a": True, "c": False}


def test_ratios_with_a_missing_policy_are_none_and_unmet() -> None:
    out = ratios({"all_resident": _policy(1.0)}, {}, "a")
    assert out["park_wake_p99_over_all_resident_p99"] is None
    assert not out["goals_met"]["park_wake_p99_over_all_resident_p99 <= 2"]


# ---- anomalies ----


def _run(resident: int, awake: int, loads: dict, evictions: dict) -> dict:
    return {
        "summary": {"errors": 0},
        "swaps": {"loads_by_kind": loads, "evictions_by_action": evictions},
        "memory_during_stream": {
            "samples": 10,
            "budget_bytes": 8 * GiB,
            "max_resident_bytes": resident,
            "samples_over_budget": 4 if resident > 8 * GiB else 0,
            "samples_three_awake": 4 if awake >= 3 else 0,
        },
    }


def test_anomalies_name_what_contradicts_the_set_up() -> None:
    report = {
        "policies": {
            "all_resident": {
                "summary": {"errors": 0},
                "footprints": {
                    "awake_after_load": {"a": 2 * GiB, "b": 2 * GiB},
                    "awake_after_wake": {"a": int(1.5 * GiB), "b": int(1.98 * GiB)},
                },
            },
            "cold_swap": _run(9 * GiB, 3, {"cold": 2}, {"stop": 1}),
            "park_wake": _run(7 * GiB, 2, {"wake": 3}, {"park": 3}),
        }
    }
    notes = anomalies(report)
    assert len(notes) == 4, notes
    assert notes[0].startswith("a: awake footprint 2048 MiB after its load but 1536 MiB")
    assert "cold_swap: the gateway counted 9216 MiB resident" in notes[1]
    assert "three models awake" in notes[2]
    assert notes[3] == (
        "cold_swap: 2 loads (cold 2, wake 0) but only 1 evictions made room during the stream"
    )
