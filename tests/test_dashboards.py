"""The Grafana dashboards are current with their generator and every query is valid PromQL."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboards.build_dashboards import DASHBOARDS

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboards"


def dashboard_queries(board: dict) -> list[str]:
    """Every panel expression with Grafana's variables replaced by plain PromQL."""
    return [
        target["expr"].replace("$__rate_interval", "1m").replace("$model", ".*")
        for panel in board["panels"]
        for target in panel["targets"]
    ]


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
                    for i, expr in enumerate(dashboard_queries(DASHBOARDS[name]))
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
