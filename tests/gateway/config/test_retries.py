"""``gateway.retries``: tries per request, backoff and the retry budget."""

from __future__ import annotations

import pytest

from gateway.config import RetrySettings
from tests.gateway.config.documents import document, gateway_doc, parsed, problems_of


def test_absent_retries_are_the_defaults():
    assert parsed(document()).gateway.retries == RetrySettings()


def test_given_values_are_read():
    retries = {"attempts": 1, "backoff_ms": 0, "budget_percent": 100, "budget_min": 0}
    assert parsed(gateway_doc(retries=retries)).gateway.retries == RetrySettings(1, 0, 100, 0)


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("attempts", 0, "must be >= 1 and <= 10, got 0"),
        ("attempts", 11, "must be >= 1 and <= 10, got 11"),
        ("backoff_ms", -1, "must be >= 0, got -1"),
        ("budget_percent", 120, "must be >= 0 and <= 100, got 120"),
        ("budget_min", -1, "must be >= 0, got -1"),
        ("budget_min", 0.5, "must be an integer, got 0.5"),
        ("tries", 3, "unknown key"),
    ],
)
def test_retry_rules(key, value, problem):
    assert problems_of(gateway_doc(retries={key: value})) == [
        f"models.yaml: gateway.retries.{key}: {problem}"
    ]
