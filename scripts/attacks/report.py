"""The report's side by side: each figure for the baseline and the current checkout, with
baseline/current ratios for times and sizes; and the table printed to stderr."""

from __future__ import annotations

import sys
from typing import Any

RATIO_SUFFIXES = ("_ms", "_s", "_mb")


def ratio(key: str, baseline: Any, current: Any) -> float | None:
    numbers = all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in (baseline, current)
    )
    if not (key.endswith(RATIO_SUFFIXES) and numbers and current):
        return None
    return round(baseline / current, 2)


def side_by_side(baseline: dict, current: dict) -> dict[str, Any]:
    """Per attack and figure: baseline, current and baseline/current for times and sizes."""
    table: dict[str, Any] = {}
    b_attacks, c_attacks = baseline.get("attacks", {}), current.get("attacks", {})
    for name in dict.fromkeys([*b_attacks, *c_attacks]):
        b = b_attacks.get(name, {}).get("figures", {})
        c = c_attacks.get(name, {}).get("figures", {})
        table[name] = {
            key: {
                "baseline": b.get(key),
                "current": c.get(key),
                "ratio": ratio(key, b.get(key), c.get(key)),
            }
            for key in dict.fromkeys([*b, *c])
        }
    return table


def print_table(report: dict) -> None:
    if "side_by_side" in report:
        print(f"{'figure':<44} {'baseline':>24} {'current':>24} {'ratio':>7}", file=sys.stderr)
        for name, rows in report["side_by_side"].items():
            print(name, file=sys.stderr)
            for key, row in rows.items():
                r = "" if row["ratio"] is None else f"{row['ratio']:g}"
                print(
                    f"  {key:<42} {row['baseline']!s:>24} {row['current']!s:>24} {r:>7}",
                    file=sys.stderr,
                )
        return
    for name, result in report["result"].get("attacks", {}).items():
        print(name, file=sys.stderr)
        for key, value in result["figures"].items():
            print(f"  {key:<42} {value!s:>24}", file=sys.stderr)
