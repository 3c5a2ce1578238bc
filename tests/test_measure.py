"""scripts/measure.py against the standard library's own quantiles."""

from __future__ import annotations

import random
import statistics

import pytest

from scripts.measure import percentile


def test_percentiles_match_the_inclusive_quantiles():
    values = [random.Random(7).uniform(0, 100) for _ in range(101)]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for q in (1, 10, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(cuts[q - 1])
    assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)


def test_empty_and_single():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
