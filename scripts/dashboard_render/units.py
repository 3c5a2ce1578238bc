"""Values as Grafana's units print them on an axis or a stat panel."""

from __future__ import annotations

import math
from collections.abc import Callable


def number(value: float) -> str:
    """A value as a label shows it: three significant digits, no trailing zeros."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    text = f"{value:.{max(0, 2 - math.floor(math.log10(abs(value))))}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def scaled(value: float, factor: float, suffixes: list[str]) -> str:
    """Grafana's scaledUnits: the largest power of ``factor`` below the value picks the
    suffix."""
    if value == 0 or not math.isfinite(value):
        return number(value) + suffixes[0]
    index = min(max(math.floor(math.log(abs(value), factor) + 1e-9), 0), len(suffixes) - 1)
    return number(value / factor**index) + suffixes[index]


def seconds(value: float) -> str:
    """Grafana's "s": ns, µs and ms below a second, min/hour/day/week above a minute."""
    if value == 0 or not math.isfinite(value):
        return number(value) + " s"
    for below, factor, suffix in (
        (1e-6, 1e-9, " ns"), (1e-3, 1e-6, " µs"), (1, 1e-3, " ms"), (60, 1, " s"),
        (3600, 60, " min"), (86400, 3600, " hour"), (604800, 86400, " day"),
        (31536000, 604800, " week"),
    ):  # fmt: skip
        if abs(value) < below:
            return number(value / factor) + suffix
    return number(value / 31556900) + " year"


SI = [" ", " k", " M", " G", " T", " P"]
IEC = [" ", " Ki", " Mi", " Gi", " Ti", " Pi"]
COUNT = ["", "K", "M", "B", "T"]
FORMATTERS: dict[str, Callable[[float], str]] = {
    "short": lambda v: scaled(v, 1000, ["", " K", " Mil", " Bil", " Tri"]),
    "none": number,
    "percent": lambda v: number(v) + "%",
    "percentunit": lambda v: number(v * 100) + "%",
    "s": seconds,
    "ms": lambda v: seconds(v / 1000),
    "bytes": lambda v: scaled(v, 1024, [s + "B" for s in IEC]),
    "decbytes": lambda v: scaled(v, 1000, [s + "B" for s in SI]),
    "Bps": lambda v: scaled(v, 1000, [s + "B/s" for s in SI]),
    "bps": lambda v: scaled(v, 1000, [s + "bps" for s in SI]),
    **{
        unit: (lambda u: lambda v: scaled(v, 1000, COUNT) + " " + u)(unit)
        for unit in ("reqps", "ops", "cps", "rps", "wps", "iops")
    },
}


def format_value(value: float, unit: str) -> str:
    """``value`` as Grafana shows it in ``unit``; an unknown unit is a suffix, as in Grafana."""
    if unit.startswith("suffix:"):
        return f"{number(value)}{unit[7:]}"
    formatter = FORMATTERS.get(unit)
    return formatter(value) if formatter else f"{number(value)} {unit}"
