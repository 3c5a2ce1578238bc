"""Grafana's side of a dashboard: the time window and its step, the template variables a query
names (each at \"All\"), the queries as Grafana sends them, and series names from legendFormat."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone

MAX_POINTS = 600  # Grafana's maxDataPoints is the panel's width in pixels: about this


DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# Grafana's roundInterval: (below this many seconds, the interval), for window / max points.
ROUND_INTERVALS = [
    (0.015, 0.01), (0.035, 0.02), (0.075, 0.05), (0.15, 0.1), (0.35, 0.2), (0.75, 0.5),
    (1.5, 1), (3.5, 2), (7.5, 5), (12.5, 10), (17.5, 15), (25, 20), (45, 30),
    (90, 60), (210, 120), (450, 300), (750, 600), (1050, 900), (1500, 1200), (2700, 1800),
    (5400, 3600), (9000, 7200), (16200, 10800), (32400, 21600), (86400, 43200),
    (604800, 86400), (1814400, 604800), (math.inf, 2592000),
]  # fmt: skip


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus/Grafana duration: ``90s``, ``10m``, ``1h30m``, ``500ms``."""
    parts = DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 10m, 1h30m)")
    return sum(float(number) * UNIT_SECONDS[unit] for number, unit in parts)


def format_duration(seconds: float) -> str:
    """A PromQL duration for ``seconds``: whole seconds when it is, else milliseconds."""
    if seconds >= 1 and float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


def parse_time(text: str) -> float:
    """Unix seconds from unix seconds or ISO 8601 (``Z`` or an offset; none means UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def round_interval(seconds: float) -> float:
    return next(interval for below, interval in ROUND_INTERVALS if seconds < below)


@dataclass(frozen=True)
class Window:
    """The time range the panels show, at Grafana's step for it."""

    start: float
    end: float
    step: float
    scrape: float

    @classmethod
    def choose(cls, start: float, end: float, scrape: float, step: float | None = None) -> Window:
        """Grafana's step (at least the scrape interval), with start and end aligned to it as
        its Prometheus data source aligns them (so that reruns hit the same samples)."""
        step = step or max(scrape, round_interval((end - start) / MAX_POINTS))
        return cls(math.floor(start / step) * step, math.ceil(end / step) * step, step, scrape)

    @property
    def rate_interval(self) -> float:
        return max(self.step + self.scrape, 4 * self.scrape)


def grafana_variables(board: dict, window: Window) -> dict[str, str]:
    """Every variable a query may name, as Grafana fills it in with each template variable at
    "All" (its allValue; without one Grafana would list every value, which ``.*`` matches)."""
    variables = {
        "__interval": format_duration(window.step),
        "__interval_ms": str(round(window.step * 1000)),
        "__rate_interval": format_duration(window.rate_interval),
        "__range": format_duration(window.end - window.start),
        "__range_s": str(round(window.end - window.start)),
        "__range_ms": str(round((window.end - window.start) * 1000)),
    }
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") != "datasource":
            variables[variable["name"]] = variable.get("allValue") or ".*"
    return variables


def expand(expr: str, variables: dict[str, str]) -> str:
    """``$name``, ``${name}`` and ``[[name]]`` replaced; unknown names left as they are."""
    pattern = r"\$\{(\w+)\}|\[\[(\w+)\]\]|\$(\w+)"

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        return variables.get(name, match.group(0))

    return re.sub(pattern, value, expr)


def dashboard_queries(board: dict, window: Window) -> list[str]:
    """Every panel's every query, as Grafana sends it for ``window``."""
    variables = grafana_variables(board, window)
    return [
        expand(target["expr"], variables)
        for panel in board["panels"]
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
