"""One dashboard drawn as one image with matplotlib: panels where gridPos puts them, time series
with gaps and legends, stat panels as a big number, \"No data\" where nothing came."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scripts.dashboard_render.grafana import Window, format_duration
from scripts.dashboard_render.prometheus import PanelData, Series, panel_unit
from scripts.dashboard_render.units import format_value

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
