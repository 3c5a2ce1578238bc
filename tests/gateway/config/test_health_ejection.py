"""``gateway.health`` (active checks) and ``gateway.ejection`` (passive outlier ejection)."""

from __future__ import annotations

import pytest

from gateway.config import EjectionSettings, HealthSettings
from tests.gateway.config.documents import document, gateway_doc, parsed, problems_of


def test_absent_sections_are_the_defaults():
    settings = parsed(document()).gateway
    assert settings.health == HealthSettings()
    assert settings.ejection == EjectionSettings()


def test_given_values_are_read():
    settings = parsed(
        gateway_doc(
            health={"interval_s": 0.05, "timeout_s": 0.5, "unhealthy_after": 3, "healthy_after": 2},
            ejection={"consecutive_failures": 1, "base_s": 1, "max_s": 10, "max_percent": 0},
        )
    ).gateway
    assert settings.health == HealthSettings(0.05, 0.5, 3, 2)
    assert settings.ejection == EjectionSettings(1, 1.0, 10.0, 0.0)


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("interval_s", 0.01, "must be >= 0.05, got 0.01"),
        ("timeout_s", 0, "must be > 0, got 0"),
        ("unhealthy_after", 0, "must be >= 1, got 0"),
        ("healthy_after", 1.5, "must be an integer, got 1.5"),
        ("interval", 1, "unknown key"),
    ],
)
def test_health_rules(key, value, problem):
    assert problems_of(gateway_doc(health={key: value})) == [
        f"models.yaml: gateway.health.{key}: {problem}"
    ]


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("consecutive_failures", 0, "must be >= 1, got 0"),
        ("base_s", 0, "must be > 0, got 0"),
        ("max_s", -5, "must be > 0, got -5"),
        ("max_percent", 101, "must be >= 0 and <= 100, got 101"),
        ("max_percent", -1, "must be >= 0 and <= 100, got -1"),
        ("base", 1, "unknown key"),
    ],
)
def test_ejection_rules(key, value, problem):
    assert problems_of(gateway_doc(ejection={key: value})) == [
        f"models.yaml: gateway.ejection.{key}: {problem}"
    ]
