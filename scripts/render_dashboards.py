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
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a plain script: make `scripts` importable
    sys.path.insert(0, str(REPO))

from scripts.dashboard_render.drawing import draw_dashboard  # noqa: E402
from scripts.dashboard_render.grafana import (  # noqa: E402
    Window,
    format_duration,
    grafana_variables,
    parse_duration,
    parse_time,
)
from scripts.dashboard_render.prometheus import (  # noqa: E402
    PrometheusUnreachable,
    QueryFailed,
    panel_data,
    scrape_interval,
)
from scripts.measure import write_report  # noqa: E402

DASHBOARD_FILES = sorted((REPO / "dashboards").glob("modelyard-*.json"))


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
