"""plan_room (gateway/residency/plan.py), a test per rule."""

from __future__ import annotations

from gateway.residency.plan import Eviction, Need, Resident, plan_room

GiB = 2**30


def resident(name: str, awake: bool = True, last_used: float = 0.0, **kw) -> Resident:
    values = {"awake_bytes": 4 * GiB, "parked_bytes": GiB, "gpu_fraction": 0.0,
              "evictable": True, **kw}  # fmt: skip
    return Resident(name=name, awake=awake, last_used=last_used, **values)


def test_what_fits_evicts_nothing():
    assert plan_room(Need(4 * GiB), 8 * GiB, 0.95, [resident("a")]) == []


def test_least_recently_used_idle_model_is_parked_first():
    residents = [resident("old", last_used=1), resident("new", last_used=2)]
    assert plan_room(Need(4 * GiB), 10 * GiB, 0.95, residents) == [Eviction("old", "park")]


def test_lower_priority_goes_before_older_use():
    residents = [resident("old", last_used=1, priority=5), resident("new", last_used=2)]
    assert plan_room(Need(4 * GiB), 10 * GiB, 0.95, residents) == [Eviction("new", "park")]


def test_pinned_or_busy_models_never_make_room():
    residents = [resident("pinned", evictable=False), resident("busy", evictable=False)]
    assert plan_room(Need(4 * GiB), 10 * GiB, 0.95, residents) is None


def test_parked_models_are_stopped_only_after_every_idle_one_is_parked():
    residents = [resident("parked", awake=False, last_used=0), resident("awake", last_used=5)]
    # 1 + 4 held; the newcomer needs 4 of 7: parking "awake" (frees 3) suffices.
    assert plan_room(Need(4 * GiB), 7 * GiB, 0.95, residents) == [Eviction("awake", "park")]
    # needing 5.5 of 7, parking leaves 2 held: stop the least recently used parked one too.
    assert plan_room(Need(GiB * 11 // 2), 7 * GiB, 0.95, residents) == [
        Eviction("awake", "park"),
        Eviction("parked", "stop"),
    ]


def test_a_model_parked_then_stopped_is_just_stopped():
    assert plan_room(Need(6 * GiB), 6 * GiB, 0.95, [resident("a")]) == [Eviction("a", "stop")]


def test_nothing_is_evicted_when_even_everything_would_not_do():
    assert plan_room(Need(9 * GiB), 8 * GiB, 0.95, [resident("a")]) is None


def test_gpu_fraction_is_a_budget_of_its_own():
    residents = [resident("gpu", gpu_fraction=0.6, awake_bytes=GiB, parked_bytes=GiB // 2)]
    # plenty of host memory, but 0.6 + 0.5 > 0.95 on the card: park it (parked holds no GPU)
    assert plan_room(Need(GiB, 0.5), 64 * GiB, 0.95, residents) == [Eviction("gpu", "park")]
    assert plan_room(Need(GiB, 0.3), 64 * GiB, 0.95, residents) == []


def test_without_parking_every_eviction_is_a_stop():
    residents = [resident("old", last_used=1), resident("new", last_used=2)]
    assert plan_room(Need(4 * GiB), 10 * GiB, 0.95, residents, park=False) == [
        Eviction("old", "stop")
    ]
    gpu = [resident("gpu", gpu_fraction=0.6, awake_bytes=GiB)]
    assert plan_room(Need(GiB, 0.5), 64 * GiB, 0.95, gpu, park=False) == [Eviction("gpu", "stop")]


def test_structured_growth_is_reserved_once_not_per_model():
    # 2 + 2 held, 1 GiB of growth each; the newcomer 2 GiB, 1 of growth: 6 + the largest 1 = 7
    residents = [resident(n, awake_bytes=2 * GiB, growth_bytes=GiB) for n in ("a", "b")]
    assert plan_room(Need(2 * GiB, growth_bytes=GiB), 7 * GiB, 0.95, residents) == []
    # the largest growth counts, whoever's it is
    assert plan_room(Need(2 * GiB, growth_bytes=2 * GiB), 7 * GiB, 0.95, residents) == [
        Eviction("a", "park")
    ]


def test_a_parked_models_growth_is_not_reserved():
    # "big" may grow by 3 GiB while awake: parking it (3 held) leaves 1 + 2 + 1 + growth 1 = 5
    residents = [
        resident("big", awake_bytes=2 * GiB, growth_bytes=3 * GiB, last_used=1),
        resident("small", awake_bytes=2 * GiB, growth_bytes=GiB, last_used=2),
    ]
    assert plan_room(Need(GiB, growth_bytes=GiB), 5 * GiB, 0.95, residents) == [
        Eviction("big", "park")
    ]


def test_what_has_grown_past_the_budget_makes_room_like_a_load():
    # measured again, "a" holds 5 of 5.5 after compiling grammars: idle "b" (1) is parked
    residents = [
        resident("a", awake_bytes=5 * GiB, last_used=5),
        resident("b", awake_bytes=GiB, parked_bytes=GiB // 4),
    ]
    assert plan_room(Need(0), GiB * 11 // 2, 0.95, residents) == [Eviction("b", "park")]


def test_a_model_whose_parked_floor_is_no_smaller_is_not_parked_for_room():
    # "a"'s parked floor (an estimate) is its awake footprint: parking it frees nothing
    residents = [resident("a", awake_bytes=GiB, parked_bytes=GiB, last_used=1),
                 resident("b", last_used=2)]  # fmt: skip
    assert plan_room(Need(2 * GiB), 6 * GiB, 0.95, residents) == [Eviction("b", "park")]
