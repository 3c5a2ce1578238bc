"""What every benchmark reports the same way: percentiles of a sample, the JSON report."""

from __future__ import annotations

import json
import math
from pathlib import Path


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linearly interpolated between ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def write_report(report: dict, out: Path | None) -> None:
    """Print ``report`` as indented JSON, and write it to ``out`` too when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
