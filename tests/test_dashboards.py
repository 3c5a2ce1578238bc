"""The Grafana dashboards are current with their generator and every query is valid PromQL; the
renderer (scripts/render_dashboards.py) fills in Grafana's variables, units and legends as
Grafana does and draws every kind of panel (tests/test_observability.py draws the real ones from
a live Prometheus)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common.net import free_port
from dashboards.build_dashboards import DASHBOARDS
from scripts import render_dashboards
from scripts.dashboard_render import drawing, grafana, prometheus, units

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboards"
WINDOW = grafana.Window.choose(
    0, 3600, scrape=15
)  # Grafana's defaults: the last hour, 15 s scrapes


def assert_dashboard_png(path: Path, board: dict) -> None:
    """A whole PNG at the size the renderer lays ``board`` out at."""
    from PIL import Image

    with Image.open(path) as image:
        assert (image.format, image.size) == ("PNG", drawing.image_size(board))
        image.verify()  # every chunk there and its checksum right
    assert path.stat().st_size > 20_000, "too small for panels with titles, axes and lines"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_committed_json_matches_generator(name: str) -> None:
    committed = json.loads((DASHBOARD_DIR / name).read_text())
    assert committed == DASHBOARDS[name], "run: python dashboards/build_dashboards.py"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_query_is_valid_promql(name: str, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: `make test` installs Debian's prometheus package")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query{i}", "expr": expr}
                    for i, expr in enumerate(grafana.dashboard_queries(DASHBOARDS[name], WINDOW))
                ],
            }
        ]
    }
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_example_prometheus_config_is_valid() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: `make test` installs Debian's prometheus package")
    result = subprocess.run(
        [promtool, "check", "config", str(DASHBOARD_DIR / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_grafana_variable_is_filled_in(name: str) -> None:
    queries = grafana.dashboard_queries(DASHBOARDS[name], WINDOW)
    assert len(queries) >= 10
    assert [q for q in queries if "$" in q or "[[" in q] == []
    assert any('=~".*"' in q for q in queries)  # $model at All
    assert any("[60s]" in q for q in queries)  # $__rate_interval: 4 x 15 s


@pytest.mark.parametrize(
    ("window_s", "scrape_s", "step", "rate_interval"),
    [(600, 1, 1, 4), (3600, 15, 15, 60), (6 * 3600, 15, 30, 60), (86400, 15, 120, 135)],
)
def test_step_and_rate_interval_are_grafanas(
    window_s: float, scrape_s: float, step: float, rate_interval: float
) -> None:
    window = grafana.Window.choose(1000, 1000 + window_s, scrape_s)
    assert (window.step, window.rate_interval) == (step, rate_interval)
    assert window.start % step == 0 and window.end % step == 0  # aligned, as Grafana does


def test_window_from_the_command_line() -> None:
    assert grafana.parse_duration("1h30m") == 5400 and grafana.parse_duration("500ms") == 0.5
    assert grafana.parse_time("2026-01-02T10:00:00Z") == grafana.parse_time("1767348000")
    with pytest.raises(ValueError):
        grafana.parse_duration("10 minutes")


@pytest.mark.parametrize(
    ("legend_format", "labels", "expected"),
    [
        ("{{code}} {{model}}", {"code": "200", "model": "tiny"}, "200 tiny"),
        ("p99 {{ model }}", {"model": "tiny"}, "p99 tiny"),
        ("{{backend}}", {}, "backend"),  # Grafana writes a missing label's name
        ("", {"__name__": "up", "job": "gateway"}, 'up{job="gateway"}'),
        ("", {}, "sum(up)"),
    ],
)
def test_legend_is_grafanas(legend_format: str, labels: dict, expected: str) -> None:
    assert prometheus.legend(legend_format, labels, "sum(up)") == expected


@pytest.mark.parametrize(
    ("unit", "value", "text"),
    [
        ("s", 0.25, "250 ms"),
        ("s", 0.0004, "400 µs"),
        ("s", 1.5, "1.5 s"),
        ("s", 90, "1.5 min"),
        ("s", 0, "0 s"),
        ("percentunit", 0.125, "12.5%"),
        ("percent", 40, "40%"),
        ("bytes", 1.5 * 2**30, "1.5 GiB"),
        ("bytes", 512, "512 B"),
        ("reqps", 1500, "1.5K reqps"),
        ("reqps", 0.333333, "0.333 reqps"),
        ("short", 2_500_000, "2.5 Mil"),
        ("short", 12, "12"),
        ("tokens/s", 3, "3 tokens/s"),  # an unknown unit is a suffix
    ],
)
def test_units_are_grafanas(unit: str, value: float, text: str) -> None:
    assert units.format_value(value, unit) == text


def test_an_unreachable_prometheus_is_an_error(tmp_path: Path, capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert (
        render_dashboards.main(["--prometheus", url, "--since", "5m", "--out", str(tmp_path)]) == 2
    )
    assert f"cannot reach Prometheus at {url}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def panel(kind: str, title: str, x: int, y: int, w: int = 12, unit: str = "s") -> dict:
    return {
        "type": kind,
        "title": title,
        "gridPos": {"x": x, "y": y, "w": w, "h": 1 if kind == "row" else 8},
        "fieldConfig": {"defaults": {"unit": unit}},
        "targets": [{"refId": "A", "expr": "x", "legendFormat": "{{model}}"}],
    }


def test_every_kind_of_panel_is_drawn(tmp_path: Path) -> None:
    """A row, graphs with data, without and with a refused query, stats with and without."""
    t = [1000.0 + i for i in range(60)]
    curve = prometheus.Series("p99 tiny", t, [0.1 + 0.01 * (i % 7) for i in range(60)])
    only_nan = prometheus.Series("p99 idle", t, [math.nan] * 60)
    board = {
        "uid": "synthetic",
        "title": "Synthetic",
        "panels": [
            panel("row", "Requests", 0, 0, 24),
            panel("timeseries", "Latency", 0, 1),
            panel("timeseries", "Never a number", 12, 1),
            panel("timeseries", "Refused", 0, 9),
            panel("stat", "Last latency", 12, 9, 6),
            panel("gauge", "Nothing", 18, 9, 6, unit="percentunit"),
        ],
    }
    series = [[curve, only_nan], [only_nan], [], [curve], []]
    panels = [prometheus.PanelData(board["panels"][0], [])] + [
        prometheus.PanelData(p, [prometheus.TargetData("A", s)])
        for p, s in zip(board["panels"][1:], series, strict=True)
    ]
    panels[3].targets[0].error = "bad_data: parse error"
    window = grafana.Window.choose(t[0], t[-1], scrape=1)
    figure = drawing.draw_dashboard(board, panels, window, tmp_path / "synthetic.png")

    texts = [text.get_text() for text in figure.texts]
    assert texts.count("No data") == 2  # the NaN-only graph and the empty gauge
    assert "query failed: bad_data: parse error" in texts
    assert "130 ms" in texts  # the stat: the last value, in the panel's unit
    latency = figure.axes[0]
    assert [t.get_text() for t in latency.get_legend().get_texts()] == ["p99 tiny", "p99 idle"]
    assert latency.yaxis.get_major_formatter()(0.25, 0) == "250 ms"
    assert_dashboard_png(tmp_path / "synthetic.png", board)
    summary = panels[1].summary()
    assert (summary["series"], summary["points"]) == (2, 60)  # NaN is not a point


def test_a_lone_number_gets_a_dot_and_rates_start_at_zero() -> None:
    nan = math.nan
    assert drawing.isolated([nan, 1, nan, 2, 3, nan, 4]) == [1, 6]

    def limits(*values: float) -> tuple[float, float] | None:
        return drawing.y_limits([prometheus.Series("", list(range(len(values))), list(values))])

    assert limits(0, 0, nan) == (0, 1)
    assert limits(0.2, 0.5) == pytest.approx((0, 0.55))
    assert limits(0.48, 0.5) is None  # far from 0: the axis stays close to the values
    assert limits(-1, 1) is None


def test_byte_axes_tick_at_round_binary_sizes() -> None:
    assert drawing.binary_tick_step("bytes", 18.6 * 2**30) == 5 * 2**30  # not 4.66 GiB
    assert drawing.binary_tick_step("bytes", 600 * 2**20) == 200 * 2**20
    assert drawing.binary_tick_step("bytes", 100) is None
    assert drawing.binary_tick_step("s", 2**30) is None
