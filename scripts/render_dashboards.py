#!/usr/bin/env python
"""Draw the Grafana dashboards as PNGs from a Prometheus, without Grafana.

Every panel's queries run as range queries (/api/v1/query_range) over a time window, and each
dashboard becomes one image laid out as Grafana's gridPos lays it out, with Grafana's units,
legends and "No data".

Template variables get what Grafana gives them with every variable at "All": ``$model`` its
allValue, ``$__interval`` the step (Grafana's rounding of window / max points, at least the scrape
interval), ``$__rate_interval`` max($__interval + scrape interval, 4 x scrape interval). The scrape
interval is Prometheus' own global one unless given.

    python scripts/render_dashboards.py --prometheus http://127.0.0.1:9090 --since 10m --out DIR
    python scripts/render_dashboards.py --start 2026-01-02T10:00:00Z --end 2026-01-02T11:00:00Z ...

Writes DIR/<dashboard uid>.png and DIR/summary.json (also printed: per panel its title, series
and points drawn). Exit status 2 when Prometheus cannot be reached, 1 when a query fails.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a plain script: make `scripts` importable
    sys.path.insert(0, str(REPO))

from scripts.measure import write_report  # noqa: E402

DASHBOARD_FILES = sorted((REPO / "dashboards").glob("modelyard-*.json"))
MAX_POINTS = 600  # Grafana's maxDataPoints is the panel's width in pixels: about this
HTTP_TIMEOUT_S = 10.0

# ---- time, steps and Grafana's variables ----

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


# ---- Prometheus ----


class PrometheusUnreachable(Exception):
    pass


class QueryFailed(Exception):
    pass


def prometheus_get(base: str, path: str, params: dict[str, Any] | None = None) -> Any:
    """``data`` of a Prometheus API answer; QueryFailed with its error for a refused query."""
    url = f"{base.rstrip('/')}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as exc:  # 400/422/503 carry Prometheus' error as JSON
        try:
            body = json.loads(exc.read())
        except ValueError:
            raise QueryFailed(f"HTTP {exc.code} from {url}") from exc
    except (OSError, ValueError) as exc:
        raise PrometheusUnreachable(f"cannot reach Prometheus at {base}: {exc}") from exc
    if body.get("status") != "success":
        raise QueryFailed(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]


def scrape_interval(base: str) -> float:
    """Prometheus' global scrape interval (what Grafana's data source should be set to)."""
    config = yaml.safe_load(prometheus_get(base, "/api/v1/status/config")["yaml"])
    return parse_duration(config.get("global", {}).get("scrape_interval", "1m"))


def query_range(base: str, expr: str, window: Window) -> list[dict]:
    params = {"query": expr, "start": window.start, "end": window.end, "step": window.step}
    data = prometheus_get(base, "/api/v1/query_range", params)
    return data["result"]


# ---- panels' data ----


@dataclass
class Series:
    legend: str
    times: list[float]
    values: list[float]

    @property
    def points(self) -> int:
        """The points a graph draws: NaN (histogram_quantile of no requests) is a gap."""
        return sum(math.isfinite(v) for v in self.values)


@dataclass
class TargetData:
    ref_id: str
    series: list[Series] = field(default_factory=list)
    error: str | None = None


@dataclass
class PanelData:
    panel: dict
    targets: list[TargetData]

    @property
    def series(self) -> list[Series]:
        return [s for t in self.targets for s in t.series]

    def summary(self) -> dict[str, Any]:
        return {
            "title": self.panel.get("title", ""),
            "type": self.panel.get("type"),
            "unit": panel_unit(self.panel),
            "series": len(self.series),
            "points": sum(s.points for s in self.series),
            "targets": [
                {
                    "refId": t.ref_id,
                    "series": len(t.series),
                    "points": sum(s.points for s in t.series),
                    **({"error": t.error} if t.error else {}),
                }
                for t in self.targets
            ],
        }


def legend(legend_format: str, labels: dict[str, str], expr: str) -> str:
    """Grafana's series name: ``{{label}}`` replaced by its value (by the label's name when the
    series lacks it, as Grafana does); without a format, ``metric{labels}``, or the query for a
    series with no labels at all."""
    if legend_format and legend_format != "__auto":
        return re.sub(
            r"\{\{\s*(.+?)\s*\}\}", lambda m: labels.get(m.group(1)) or m.group(1), legend_format
        )
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest else name or expr


def to_series(result: dict, legend_format: str, expr: str) -> Series:
    times = [float(t) for t, _ in result["values"]]
    values = [float(v) for _, v in result["values"]]  # "NaN", "+Inf" parse as floats
    return Series(legend(legend_format, result["metric"], expr), times, values)


def panel_data(base: str, panel: dict, variables: dict[str, str], window: Window) -> PanelData:
    """Every target of ``panel`` queried; a refused query is kept as that target's error."""
    targets = []
    for target in panel.get("targets", []):
        if target.get("hide") or not target.get("expr"):
            continue
        expr = expand(target["expr"], variables)
        data = TargetData(target.get("refId", "?"))
        try:
            results = query_range(base, expr, window)
            data.series = [to_series(r, target.get("legendFormat", ""), expr) for r in results]
        except QueryFailed as exc:
            data.error = str(exc)
        targets.append(data)
    return PanelData(panel, targets)


def panel_unit(panel: dict) -> str:
    return panel.get("fieldConfig", {}).get("defaults", {}).get("unit") or "short"


# ---- Grafana's units ----


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


# ---- drawing ----

GRID_COLUMNS = 24
WIDTH_IN = 16.0
UNIT_IN = 0.4  # one gridPos height unit (Grafana: 30 px)
HEADER_IN = 0.6
GAP_IN = 0.06
TITLE_IN = 0.32
XTICKS_IN = 0.3
YTICKS_IN = 0.85
LEGEND_ROW_IN = 0.19
LEGEND_ROWS = 3  # then "+N more"
DPI = 100
# Grafana's classic palette, in its order.
PALETTE = ["#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9",
           "#705DA0", "#508642", "#CCA300", "#447EBC", "#C15C17", "#890F02", "#0A437C"]  # fmt: skip


@dataclass(frozen=True)
class Box:
    """A rectangle in inches from the figure's top-left corner."""

    x: float
    y: float
    w: float
    h: float


def panel_box(grid_pos: dict) -> Box:
    """Where gridPos puts a panel: 24 columns across the width, ``h`` in height units."""
    column = WIDTH_IN / GRID_COLUMNS
    return Box(
        grid_pos.get("x", 0) * column + GAP_IN / 2,
        HEADER_IN + grid_pos.get("y", 0) * UNIT_IN + GAP_IN / 2,
        grid_pos.get("w", 12) * column - GAP_IN,
        grid_pos.get("h", 8) * UNIT_IN - GAP_IN,
    )


def figure_height(panels: Iterable[dict]) -> float:
    bottom = max(
        (p.get("gridPos", {}).get("y", 0) + p.get("gridPos", {}).get("h", 8) for p in panels),
        default=8,
    )
    return HEADER_IN + bottom * UNIT_IN + GAP_IN


def image_size(board: dict) -> tuple[int, int]:
    """The PNG's width and height in pixels for ``board``."""
    return round(WIDTH_IN * DPI), round(figure_height(board["panels"]) * DPI)


class Canvas:
    """A figure addressed in inches from the top-left, as the grid is."""

    def __init__(self, height: float) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # no display needed
        from matplotlib.figure import Figure

        self.figure = Figure(figsize=(WIDTH_IN, height), dpi=DPI, facecolor="#f4f5f5")
        FigureCanvasAgg(self.figure)
        self.height = height

    def rect(self, box: Box) -> tuple[float, float, float, float]:
        """[left, bottom, width, height] in figure fractions."""
        return (
            box.x / WIDTH_IN,
            1 - (box.y + box.h) / self.height,
            box.w / WIDTH_IN,
            box.h / self.height,
        )

    def point(self, x: float, y: float) -> tuple[float, float]:
        return x / WIDTH_IN, 1 - y / self.height

    def text(self, x: float, y: float, text: str, **style: Any) -> None:
        self.figure.text(*self.point(x, y), text, **style)

    def frame(self, box: Box) -> None:
        from matplotlib.patches import Rectangle

        left, bottom, width, height = self.rect(box)
        self.figure.patches.append(
            Rectangle(
                (left, bottom), width, height, transform=self.figure.transFigure,
                facecolor="white", edgecolor="#d8d9da", linewidth=0.8,
                zorder=-1,  # under the axes (zorder 0)
            )
        )  # fmt: skip

    def axes(self, box: Box) -> Any:
        return self.figure.add_axes(self.rect(box))


def legend_layout(labels: list[str], width: float) -> tuple[list[str], int]:
    """The entries shown (at most LEGEND_ROWS rows, the rest counted in a "+N more") and how
    many columns fit across ``width`` inches."""
    entry_in = 0.45 + 0.062 * max((len(label) for label in labels), default=1)
    columns = max(1, min(len(labels), int(width // entry_in)))
    fits = columns * LEGEND_ROWS
    if len(labels) > fits:
        labels = [*labels[: fits - 1], f"+{len(labels) - fits + 1} more"]
    return labels, columns


def with_gaps(series: Series, step: float) -> tuple[list[float], list[float]]:
    """Points with a NaN wherever samples are missing, so that the line breaks there as
    Grafana's does instead of joining across the hole."""
    times, values = [], []
    for i, (t, v) in enumerate(zip(series.times, series.values, strict=True)):
        if i and t - series.times[i - 1] > 1.5 * step:
            times.append(t - step)
            values.append(math.nan)
        times.append(t)
        values.append(v if math.isfinite(v) else math.nan)
    return times, values


def isolated(values: list[float]) -> list[int]:
    """The numbers with no number beside them: a line cannot show them, a dot does (Grafana
    shows points where they are this sparse)."""
    finite = [math.isfinite(v) for v in values]
    return [
        i
        for i, here in enumerate(finite)
        if here and not (i and finite[i - 1]) and not (i + 1 < len(finite) and finite[i + 1])
    ]


def y_limits(series: list[Series]) -> tuple[float, float] | None:
    """From 0 where the values are not negative and 0 is near them (rates, counts, ratios), as
    Grafana shows such panels; 0 to 1 when they are all 0. None: leave it to matplotlib."""
    values = [v for s in series for v in s.values if math.isfinite(v)]
    low, high = min(values, default=0.0), max(values, default=0.0)
    if low < 0 or (low > high / 2 and low != high):
        return None
    return (0.0, high * 1.1) if high > 0 else (0.0, 1.0)


def binary_tick_step(unit: str, high: float) -> float | None:
    """For bytes, a tick step that is a round number of KiB, MiB or GiB (decimal steps read
    as 4.66 GiB, 9.31 GiB); None for other units."""
    if unit != "bytes" or high < 1024:
        return None
    scale = 1024 ** math.floor(math.log(high, 1024))
    wanted = high / scale / 5  # about five ticks
    magnitude = 10 ** math.floor(math.log10(wanted))
    return scale * magnitude * next(m for m in (1, 2, 2.5, 5, 10) if m * magnitude >= wanted)


def draw_no_data(
    canvas: Canvas, box: Box, message: str = "No data", color: str = "#8e8e8e"
) -> None:
    canvas.text(
        box.x + box.w / 2, box.y + box.h / 2, message, ha="center", va="center",
        fontsize=13, color=color, wrap=True,
    )  # fmt: skip


def draw_timeseries(canvas: Canvas, box: Box, data: PanelData, window: Window) -> None:
    """Lines over the window, y ticks in the panel's unit, the legend below, as Grafana does."""
    from matplotlib.dates import AutoDateLocator, DateFormatter
    from matplotlib.ticker import FuncFormatter, MaxNLocator, MultipleLocator

    series = data.series
    labels, columns = legend_layout([s.legend for s in series], box.w - 0.2)
    legend_in = LEGEND_ROW_IN * math.ceil(len(labels) / columns) + 0.08
    plot = Box(
        box.x + YTICKS_IN,
        box.y + TITLE_IN,
        box.w - YTICKS_IN - 0.2,
        box.h - TITLE_IN - XTICKS_IN - legend_in,
    )
    ax = canvas.axes(plot)
    lines = []
    for i, s in enumerate(series):
        times, values = with_gaps(s, window.step)
        moments = [datetime.fromtimestamp(t, timezone.utc) for t in times]
        color = PALETTE[i % len(PALETTE)]
        (line,) = ax.plot(moments, values, color=color, linewidth=1.2)
        ax.plot(moments, values, color=color, linestyle="none", marker="o", markersize=2.5,
                markevery=isolated(values))  # fmt: skip
        lines.append(line)
    if limits := y_limits(series):
        ax.set_ylim(*limits)
    ax.set_xlim(
        datetime.fromtimestamp(window.start, timezone.utc),
        datetime.fromtimestamp(window.end, timezone.utc),
    )
    span = window.end - window.start
    ax.xaxis.set_major_locator(AutoDateLocator(minticks=3, maxticks=7, tz=timezone.utc))
    ax.xaxis.set_major_formatter(
        DateFormatter("%H:%M:%S" if span < 3600 else "%H:%M", tz=timezone.utc)
    )
    unit = panel_unit(data.panel)
    binary = binary_tick_step(unit, max(abs(v) for v in ax.get_ylim()))
    ax.yaxis.set_major_locator(
        MultipleLocator(binary) if binary else MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10])
    )
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    ax.tick_params(labelsize=7.5, colors="#464c54", length=0)
    ax.grid(color="#e9e9e9", linewidth=0.6)
    for spine in ax.spines.values():
        spine.set_visible(False)
    if labels:
        handles = lines[: len(labels)]
        if len(labels) < len(series):  # the "+N more" entry has no line of its own
            handles[-1] = ax.plot([], [], color="none")[0]
        ax.legend(
            handles, labels, loc="upper left", ncol=columns, frameon=False, fontsize=7.5,
            bbox_to_anchor=canvas.point(box.x + 0.1, box.y + box.h - legend_in + 0.02),
            bbox_transform=canvas.figure.transFigure, handlelength=1.2, columnspacing=1.2,
            borderaxespad=0, borderpad=0,
        )  # fmt: skip
    if not any(s.points for s in series):
        ax.set_yticks([])
        ax.set_xticks([])
        draw_no_data(canvas, plot)


def draw_stat(canvas: Canvas, box: Box, data: PanelData) -> None:
    """Stat and gauge panels: each series' last value as a big number, its name below."""
    shown = [s for s in data.series if s.points][:4]
    if not shown:
        draw_no_data(canvas, box)
        return
    unit, width = panel_unit(data.panel), box.w / len(shown)
    for i, s in enumerate(shown):
        last = next(v for v in reversed(s.values) if math.isfinite(v))
        middle = box.x + width * (i + 0.5)
        canvas.text(
            middle, box.y + TITLE_IN + (box.h - TITLE_IN) * 0.45, format_value(last, unit),
            ha="center", va="center", fontsize=30, color=PALETTE[i], fontweight="bold",
        )  # fmt: skip
        if len(data.series) > 1 or s.legend:
            canvas.text(middle, box.y + box.h - 0.2, s.legend, ha="center", fontsize=8)


def draw_panel(canvas: Canvas, data: PanelData, window: Window) -> None:
    box = panel_box(data.panel.get("gridPos", {}))
    title = data.panel.get("title", "")
    if data.panel.get("type") == "row":  # a row is a header across the grid, no frame
        canvas.text(box.x, box.y + box.h * 0.7, title, fontsize=12, fontweight="bold")
        return
    canvas.frame(box)
    canvas.text(box.x + 0.12, box.y + 0.22, title, fontsize=10, fontweight="bold", color="#1f2328")
    errors = [t.error for t in data.targets if t.error]
    if errors:  # Grafana shows a refused query on the panel, in red
        draw_no_data(canvas, box, "query failed: " + errors[0][:120], color="#c4162a")
    elif data.panel.get("type") in ("stat", "gauge", "bargauge"):
        draw_stat(canvas, box, data)
    else:
        draw_timeseries(canvas, box, data, window)


def draw_dashboard(board: dict, panels: list[PanelData], window: Window, path: Path) -> Any:
    """The dashboard written to ``path`` as PNG; the matplotlib Figure."""
    canvas = Canvas(figure_height(p.panel for p in panels))
    when = (
        f"{datetime.fromtimestamp(window.start, timezone.utc):%Y-%m-%d %H:%M:%S} to "
        f"{datetime.fromtimestamp(window.end, timezone.utc):%H:%M:%S} UTC"
    )
    details = (
        f"{when}   step {format_duration(window.step)}   "
        f"$__rate_interval {format_duration(window.rate_interval)}   all variables: All"
    )
    canvas.text(0.12, 0.33, board.get("title", board.get("uid", "")), fontsize=15)
    canvas.text(WIDTH_IN - 0.12, 0.33, details, fontsize=9, ha="right", color="#464c54")
    for data in panels:
        draw_panel(canvas, data, window)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.figure.savefig(path, dpi=DPI, facecolor=canvas.figure.get_facecolor())
    return canvas.figure


# ---- the command ----


def render(base: str, board: dict, window: Window, out: Path) -> dict[str, Any]:
    """Query and draw one dashboard into ``out``/<uid>.png; its summary."""
    variables = grafana_variables(board, window)
    panels = [panel_data(base, panel, variables, window) for panel in board["panels"]]
    path = out / f"{board.get('uid') or board['title'].replace('/', '-')}.png"
    draw_dashboard(board, panels, window, path)
    return {
        "uid": board.get("uid"),
        "title": board.get("title"),
        "png": str(path),
        "panels": [p.summary() for p in panels if p.panel.get("type") != "row"],
    }


def window_from(args: argparse.Namespace) -> Window:
    """The command line's time range at Grafana's step for it (asks Prometheus its scrape
    interval unless given)."""
    end = parse_time(args.end) if args.end else time.time()
    start = parse_time(args.start) if args.start else end - parse_duration(args.since)
    if start >= end:
        raise ValueError("the window's start is not before its end")
    scrape = (
        parse_duration(args.scrape_interval)
        if args.scrape_interval
        else scrape_interval(args.prometheus)
    )
    return Window.choose(start, end, scrape, parse_duration(args.step) if args.step else None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="base URL")
    parser.add_argument("--since", default="1h", help="the window up to --end (default 1h)")
    parser.add_argument("--start", help="unix seconds or ISO 8601; instead of --since")
    parser.add_argument("--end", help="unix seconds or ISO 8601 (default: now)")
    parser.add_argument("--step", help="instead of Grafana's choice, e.g. 5s")
    parser.add_argument("--scrape-interval", help="default: Prometheus' global one")
    parser.add_argument(
        "--dashboard", action="append", type=Path, help="default: dashboards/modelyard-*.json"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    parser.add_argument("--summary", type=Path, help="default: OUT/summary.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        window = window_from(args)
        boards = [json.loads(path.read_text()) for path in args.dashboard or DASHBOARD_FILES]
        rendered = [render(args.prometheus, board, window, args.out) for board in boards]
    except (PrometheusUnreachable, QueryFailed, ValueError) as exc:
        print(f"render_dashboards: {exc}", file=sys.stderr)
        return 2
    summary = {
        "prometheus": args.prometheus,
        "start": window.start,
        "end": window.end,
        "step": format_duration(window.step),
        "rate_interval": format_duration(window.rate_interval),
        "dashboards": rendered,
    }
    write_report(summary, args.summary or args.out / "summary.json")
    failed = [
        f"{board['uid']}: {panel['title']}"
        for board in rendered
        for panel in board["panels"]
        if any("error" in t for t in panel["targets"])
    ]
    if failed:
        print(f"render_dashboards: queries failed in {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
