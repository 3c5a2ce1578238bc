"""A backend's place in rotation (gateway/backend.py): its conditions, the transition rules of its
one setter, and the metrics that follow every transition. One test per rule."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.backend import Backend, BackendState, Condition
from gateway.config import parse_config
from gateway.metrics import GatewayMetrics
from gateway.router import Router

URL = "http://127.0.0.1:9000"


def recorded() -> tuple[Backend, list[tuple[BackendState, BackendState | None]]]:
    """A backend whose listener records (state after, state before) of every call."""
    calls: list[tuple[BackendState, BackendState | None]] = []
    backend = Backend("m", URL, lambda b, before: calls.append((b.state, before)))
    return backend, calls


def test_a_new_backend_is_available_and_announced_once():
    backend, calls = recorded()
    assert backend.available and backend.state == BackendState()
    assert (backend.healthy, backend.ejected, backend.draining, backend.removed) == (
        True,
        False,
        False,
        False,
    )
    assert calls == [(BackendState(), None)]


@pytest.mark.parametrize("condition", list(Condition))
def test_any_condition_takes_a_backend_out_of_rotation(condition):
    backend, calls = recorded()
    assert backend.set_condition(condition)
    assert not backend.available and condition in backend.state
    assert calls[-1] == (BackendState(frozenset({condition})), BackendState())


@pytest.mark.parametrize("condition", [c for c in Condition if c is not Condition.REMOVED])
def test_clearing_the_last_condition_brings_it_back(condition):
    backend, calls = recorded()
    backend.set_condition(condition)
    assert backend.set_condition(condition, False)
    assert backend.available and backend.state == BackendState()
    assert calls[-1] == (BackendState(), BackendState(frozenset({condition})))


def test_it_is_available_only_when_no_condition_holds():
    backend, _ = recorded()
    backend.set_condition(Condition.DRAINING)
    backend.set_condition(Condition.UNHEALTHY)
    backend.set_condition(Condition.DRAINING, False)  # undrained, but its checks still fail
    assert not backend.available and not backend.healthy and not backend.draining
    backend.set_condition(Condition.UNHEALTHY, False)
    assert backend.available


def test_setting_a_condition_that_holds_is_no_transition():
    backend, calls = recorded()
    backend.set_condition(Condition.EJECTED)
    assert not backend.set_condition(Condition.EJECTED)
    assert len(calls) == 2  # the announcement and the first ejection only


def test_clearing_a_condition_that_does_not_hold_is_no_transition():
    backend, calls = recorded()
    assert not backend.set_condition(Condition.UNHEALTHY, False)
    assert len(calls) == 1 and backend.available


@pytest.mark.parametrize("condition", list(Condition))
@pytest.mark.parametrize("held", [True, False])
def test_removed_is_terminal(condition, held):
    backend, calls = recorded()
    backend.set_condition(Condition.UNHEALTHY)
    backend.set_condition(Condition.REMOVED)
    before = backend.state
    assert not backend.set_condition(condition, held)
    assert backend.state == before and not backend.available
    assert len(calls) == 3  # nothing reported after the removal


def test_the_state_changes_only_through_the_setter():
    backend, _ = recorded()
    for name in ("available", "healthy", "ejected", "draining", "removed", "state"):
        with pytest.raises(AttributeError):
            setattr(backend, name, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.state.conditions = frozenset({Condition.EJECTED})  # type: ignore[misc]


def test_the_router_removes_backends_whose_url_left_the_fleet():
    router = Router()
    two = parse_config({"models": [{"name": "m", "upstreams": [URL, "http://127.0.0.1:9001"]}]})
    router.apply(two)
    kept, dropped = router.resolve("m").backends
    removed = router.apply(parse_config({"models": [{"name": "m", "upstreams": [URL]}]}))
    assert removed == [dropped] and dropped.removed and not dropped.available
    assert router.resolve("m").backends == [kept] and kept.available


def _sample(metrics: GatewayMetrics, name: str, backend: Backend) -> float | None:
    labels = {"model": backend.model, "backend": backend.label}
    return metrics.registry.get_sample_value(name, labels)


def test_metrics_follow_every_transition():
    metrics = GatewayMetrics()
    router = Router(on_backend_state=metrics.backend_changed)
    router.apply(parse_config({"models": [{"name": "m", "upstreams": [URL]}]}))
    backend = router.resolve("m").backends[0]

    def series() -> tuple[float | None, float | None, float | None]:
        return (
            _sample(metrics, "modelyard_backend_up", backend),
            _sample(metrics, "modelyard_backend_ejected", backend),
            _sample(metrics, "modelyard_ejections_total", backend),
        )

    assert series() == (1, 0, 0)  # declared when the backend was created
    backend.set_condition(Condition.EJECTED)
    assert series() == (0, 1, 1)
    backend.set_condition(Condition.EJECTED)  # no transition: not counted again
    assert series() == (0, 1, 1)
    backend.set_condition(Condition.EJECTED, False)
    assert series() == (1, 0, 1)
    backend.set_condition(Condition.DRAINING)
    assert series() == (0, 0, 1)
    router.apply(parse_config({"models": [{"name": "m", "upstreams": ["http://127.0.0.1:9001"]}]}))
    assert series() == (None, None, None)  # a removed backend's series are gone
    backend.set_condition(Condition.DRAINING, False)  # a late change brings none back
    assert series() == (None, None, None)
