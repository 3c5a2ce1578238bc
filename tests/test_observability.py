"""End to end with real processes: `modelyard serve` runs real engines (the tiny test model,
pinned, and the same model on demand), a real Prometheus scrapes the gateway statically and the
engines through the gateway's HTTP service discovery (with the admin key, as docs/OPERATIONS.md
describes), every metric the dashboards name must exist there, and both dashboards are drawn from
it (scripts/render_dashboards.py) with data in every panel, so that a renamed metric, a label
filter nobody sets, a series rate() cannot see or a broken discovery fails here."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.net import free_port
from dashboards.build_dashboards import DASHBOARDS
from scripts import render_dashboards
from scripts.dashboard_render import grafana
from scripts.live_prometheus import chat, instant_query, running_prometheus, wait_for_value
from scripts.tiny_models import tiny_engine_entry
from tests.gateway.serve_process import ServeProcess
from tests.test_dashboards import assert_dashboard_png

ADMIN_KEY = "sk-admin-observability-test"
MODEL = "tiny"
ON_DEMAND = "tiny-od"  # loaded at its first request: held requests and a load time to show
REQUESTS_PER_KIND = 3  # non-streaming and streaming each, to MODEL
MAX_TOKENS = 4
METRIC_NAME = re.compile(r"\b(vllm:[a-zA-Z0-9_:]+|modelyard_[a-zA-Z0-9_]+)")
LABEL_VALUES = re.compile(r"label_values\(([^,]+),")
ANY_WINDOW = grafana.Window.choose(0, 3600, scrape=1)


def dashboard_metric_names() -> set[str]:
    names = {
        name
        for board in DASHBOARDS.values()
        for expr in grafana.dashboard_queries(board, ANY_WINDOW)
        for name in METRIC_NAME.findall(expr)
    }
    for board in DASHBOARDS.values():  # the model pickers' label_values(metric, label)
        for variable in board["templating"]["list"]:
            names.update(LABEL_VALUES.findall(variable.get("query", "")))
    return names


@pytest.fixture
def gateway(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    model = {"name": MODEL, **tiny_engine_entry(tiny_llama_dir)}
    on_demand = {**model, "name": ON_DEMAND, "residency": "on_demand", "idle_ttl_s": 3600}
    document = {
        "gateway": {
            "watch_config": False,
            "health": {"interval_s": 0.5},
            "auth": {"admin_key_env": "OBS_TEST_ADMIN_KEY"},  # open mode for clients
        },
        "models": [model, on_demand],
    }
    process = ServeProcess(
        document,
        tmp_path,
        free_port(),
        env={"OBS_TEST_ADMIN_KEY": ADMIN_KEY},
        admin_key=ADMIN_KEY,
    )
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def prometheus(tmp_path: Path, gateway: ServeProcess) -> Iterator[str]:
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus missing: `make test` installs Debian's prometheus package")
    with running_prometheus(tmp_path, gateway.url, ADMIN_KEY) as url:
        yield url


def requests_scraped(prometheus: str, gateway_count: int, engine_count: int, engine: str) -> None:
    """Until Prometheus has scraped that many answered requests from the gateway and from the
    engines (``engine``: a PromQL label filter on them)."""
    wait_for_value(prometheus, 'sum(modelyard_requests_total{code="200"})', gateway_count, 20)
    wait_for_value(prometheus, f"sum(vllm:request_success_total{engine})", engine_count, 20)


def render(prometheus: str, since: float, out: Path) -> dict:
    """Both dashboards drawn over the test's window, as the command line does it; the
    summary."""
    args = ["--prometheus", prometheus, "--start", str(since), "--out", str(out)]
    assert render_dashboards.main(args) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(120)
def test_dashboards_against_a_live_prometheus(
    gateway: ServeProcess, prometheus: str, tmp_path: Path
) -> None:
    since = time.time()
    gateway.wait_ready(replicas=1, timeout=60)
    # Scraped before any request, so that rate() sees the first event of every series there
    # from the start at zero (the on-demand model's load time, its wait in the line, ...).
    wait_for_value(
        prometheus, f'count(modelyard_admission_queue_depth{{model="{ON_DEMAND}"}})', 1, 20
    )
    wait_for_value(prometheus, 'sum(up{job="engines"})', 1, 20)
    # Held while it loads, once the pinned engine is up (< 1 s then; asked for while the pinned
    # one was still starting, it took about 5 s).
    chat(gateway.url, ON_DEMAND, stream=False, max_tokens=MAX_TOKENS)
    # Two scraped rounds of traffic: rate() sees the series that the first one creates grow.
    chat(gateway.url, MODEL, stream=False, max_tokens=MAX_TOKENS)
    chat(gateway.url, MODEL, stream=True, max_tokens=MAX_TOKENS)
    pinned = f'{{model_name="{MODEL}"}}'
    requests_scraped(prometheus, 3, 2, pinned)
    for _ in range(REQUESTS_PER_KIND - 1):
        chat(gateway.url, MODEL, stream=False, max_tokens=MAX_TOKENS)
        chat(gateway.url, MODEL, stream=True, max_tokens=MAX_TOKENS)
    chat(gateway.url, ON_DEMAND, stream=True, max_tokens=MAX_TOKENS)
    # The pinned engine's requests; the on-demand engine's may not be scraped yet (Prometheus
    # passes what discovery finds on to its scrapers every 5 s), nor does any panel need them.
    requests_scraped(prometheus, 2 * REQUESTS_PER_KIND + 2, 2 * REQUESTS_PER_KIND, pinned)

    engines = instant_query(prometheus, 'up{job="engines"}')["result"]
    found = sorted((e["metric"]["model"], e["metric"]["replica"], e["value"][1]) for e in engines)
    assert found[0] == (MODEL, "0", "1")
    assert set(found) <= {(MODEL, "0", "1"), (ON_DEMAND, "0", "1")}  # no others, all up
    assert instant_query(prometheus, 'up{job="gateway"}')["result"][0]["value"][1] == "1"

    present = {
        series["metric"]["__name__"]
        for series in instant_query(
            prometheus, 'count by (__name__) ({__name__=~"vllm:.+|modelyard_.+"})'
        )["result"]
    }
    wanted = dashboard_metric_names()
    assert len(wanted) > 20  # the extraction found the dashboards' metrics
    assert wanted - present == set(), "dashboards use metrics that nobody exports"
    # The engine's series carry the served name in model_name, as the dashboards filter on it.
    running = instant_query(prometheus, "vllm:num_requests_running")["result"]
    assert MODEL in [series["metric"]["model_name"] for series in running]

    # Every panel draws data: each query is accepted, its metric and label filters match what is
    # exported, and what it computes is a number somewhere in the window (not only NaN).
    summary = render(prometheus, since, tmp_path / "dashboards")
    empty = [
        f"{board['uid']}: {panel['title']} (query {target['refId']})"
        for board in summary["dashboards"]
        for panel in board["panels"]
        for target in panel["targets"]
        if not (target["series"] and target["points"])
    ]
    assert empty == [], "panels or queries that drew nothing"
    assert summary["rate_interval"] == "4s"  # Grafana's, from Prometheus' 1 s scrape interval
    for board in summary["dashboards"]:
        definition = DASHBOARDS[f"{board['uid']}.json"]
        assert len(board["panels"]) == len(definition["panels"])
        assert_dashboard_png(Path(board["png"]), definition)
