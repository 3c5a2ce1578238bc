"""Each panel's queries run against a Prometheus (range queries): the series, or the error, per
target."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import yaml

from scripts.dashboard_render.grafana import Window, expand, parse_duration

HTTP_TIMEOUT_S = 10.0

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
