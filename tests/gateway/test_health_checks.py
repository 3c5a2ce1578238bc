"""The active-check policy (HealthMonitor.record_check): which verdicts set and clear UNHEALTHY,
and when a check re-admits an ejected backend."""

from __future__ import annotations

import time

from gateway.backend import Backend, Condition
from gateway.config import EjectionSettings, HealthSettings
from gateway.health import HealthMonitor
from gateway.router import Router


def monitor(unhealthy_after: int = 2, healthy_after: int = 2) -> tuple[HealthMonitor, Backend]:
    health = HealthSettings(unhealthy_after=unhealthy_after, healthy_after=healthy_after)
    checks = HealthMonitor(Router(), None, health, EjectionSettings())  # type: ignore[arg-type]
    return checks, Backend("m", "http://127.0.0.1:9000")


def test_the_first_check_decides_alone():
    checks, backend = monitor()
    checks.record_check(backend, passed=False, first=True)
    assert not backend.healthy
    checks, backend = monitor()
    backend.set_condition(Condition.UNHEALTHY)
    checks.record_check(backend, passed=True, first=True)
    assert backend.healthy


def test_unhealthy_after_failures_in_a_row():
    checks, backend = monitor(unhealthy_after=2)
    checks.record_check(backend, passed=False)
    assert backend.healthy
    checks.record_check(backend, passed=True)  # a pass breaks the run
    checks.record_check(backend, passed=False)
    assert backend.healthy
    checks.record_check(backend, passed=False)
    assert not backend.healthy and not backend.available


def test_healthy_after_passes_in_a_row():
    checks, backend = monitor(healthy_after=2)
    backend.set_condition(Condition.UNHEALTHY)
    checks.record_check(backend, passed=True)
    assert not backend.healthy
    checks.record_check(backend, passed=True)
    assert backend.healthy and backend.available


def test_a_pass_readmits_an_ejected_backend_only_after_its_ejection_time():
    checks, backend = monitor(healthy_after=1)
    backend.set_condition(Condition.EJECTED)
    backend.ejected_until = time.monotonic() + 60
    backend.consecutive_failures = 3
    checks.record_check(backend, passed=True)
    assert backend.ejected and not backend.available
    backend.ejected_until = time.monotonic() - 1
    checks.record_check(backend, passed=True)
    assert not backend.ejected and backend.available
    assert backend.consecutive_failures == 0  # re-admitted with a clean streak


def test_checks_leave_draining_alone():
    checks, backend = monitor(unhealthy_after=1, healthy_after=1)
    backend.set_condition(Condition.DRAINING)
    checks.record_check(backend, passed=False)
    checks.record_check(backend, passed=True)
    assert backend.draining and backend.healthy and not backend.available
