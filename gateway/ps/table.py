"""``modelyard ps``'s table: a line with the memory budget, then a header and one line per row,
each column as wide as its widest cell and two spaces apart. Sizes in binary units (``1.2 GiB``;
``~`` marks an estimate no engine has measured yet), durations as ``45s``, ``3m12s``, ``1h02m``,
``2d03h``, and ``-`` where a figure does not apply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.sizes import format_size
from gateway.ps.rows import Row

SEPARATOR = "  "


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _name(row: Row) -> str:
    return row["model"] if row["kind"] == "model" else f"  {row['model']}#{row['replica']}"


def _memory(row: Row) -> str:
    held = row["memory_bytes"]
    if not held:  # nothing held (a stopped model), or not measured in this state yet
        return "-"
    return ("~" if row["memory_source"] == "estimated" else "") + format_size(held)


def _plain(key: str) -> Callable[[Row], str]:
    return lambda row: "-" if row[key] is None else str(row[key])


def _rate(row: Row) -> str:
    rate = row["completion_tokens_per_s"]
    return "-" if rate is None else f"{rate:.1f}"


# (header, cell, right-aligned)
COLUMNS: tuple[tuple[str, Callable[[Row], str], bool], ...] = (
    ("NAME", _name, False),
    ("ALIASES", lambda row: ",".join(row["aliases"]) or "-", False),
    ("STATE", _plain("state"), False),
    ("RESIDENCY", _plain("residency"), False),
    ("PID", _plain("pid"), True),
    ("MEMORY", _memory, True),
    ("RUN", _plain("running"), True),
    ("QUEUED", _plain("queued"), True),
    ("TOK/S", _rate, True),
    ("IDLE", lambda row: duration(row["idle_s"]), True),
    ("PARKS IN", lambda row: duration(row["ttl_left_s"]), True),
    ("UP", lambda row: duration(row["uptime_s"]), True),
    ("RESTARTS", _plain("restarts"), True),
)


def render(url: str, budget: dict[str, Any], rows: list[Row]) -> str:
    cells = [[header for header, _, _ in COLUMNS]]
    cells += [[cell(row) for _, cell, _ in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = [_budget_line(url, budget)]
    for line in cells:
        padded = (
            text.rjust(width) if right else text.ljust(width)
            for text, width, (_, _, right) in zip(line, widths, COLUMNS, strict=True)
        )
        lines.append(SEPARATOR.join(padded).rstrip())
    return "\n".join(lines)


def _budget_line(url: str, budget: dict[str, Any]) -> str:
    used, total = budget["cpu_resident_bytes"], budget["cpu_bytes"]
    share = f"{100 * used / total:.0f}%" if total else "-"
    line = f"{url}  memory {format_size(used)} of {format_size(total)} ({share})"
    if budget["templates_bytes"]:
        line += f", engine templates {format_size(budget['templates_bytes'])}"
    if budget["gpu_resident_fraction"]:
        line += f"  gpu {budget['gpu_resident_fraction']:.2f} of {budget['gpu_fraction']:.2f}"
    return line
