"""End to end with real processes: `modelyard serve` runs a real engine (the tiny test model), a
real Prometheus scrapes the gateway statically and the engine through the gateway's HTTP service
discovery (with the admin key, as docs/OPERATIONS.md describes), and every dashboard query must be
accepted by that Prometheus and every metric the dashboards name must exist there, so that a
renamed metric or a broken discovery fails here."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from common.net import free_port
from dashboards.build_dashboards import DASHBOARDS
from tests.gateway.serve_process import ServeProcess, http_get

ADMIN_KEY = "sk-admin-observability-test"
MODEL = "tiny"
REQUESTS_PER_KIND = 3  # non-streaming and streaming each
METRIC_NAME = re.compile(r"\b(vllm:[a-zA-Z0-9_:]+|modelyard_[a-zA-Z0-9_]+)")
LABEL_VALUES = re.compile(r"label_values\(([^,]+),")


def dashboard_queries() -> list[str]:
    """Every panel expression, with Grafana's variables replaced by plain PromQL."""
    return [
        target["expr"].replace("$__rate_interval", "15s").replace("$model", ".*")
        for board in DASHBOARDS.values()
        for panel in board["panels"]
        for target in panel["targets"]
    ]


def dashboard_metric_names() -> set[str]:
    names = {name for expr in dashboard_queries() for name in METRIC_NAME.findall(expr)}
    for board in DASHBOARDS.values():  # the model pickers' label_values(metric, label)
        for variable in board["templating"]["list"]:
            names.update(LABEL_VALUES.findall(variable.get("query", "")))
    return names


@pytest.fixture
def gateway(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    document = {
        "gateway": {
            "watch_config": False,
            "health": {"interval_s": 0.5},
            "auth": {"admin_key_env": "OBS_TEST_ADMIN_KEY"},  # open mode for clients
        },
        "models": [
            {
                "name": MODEL,
                "source": str(tiny_llama_dir),
                "device": "cpu",
                "max_model_len": 256,
                "max_num_seqs": 4,
                "kv_cache_memory": "16MiB",
                "engine_args": ["--num-threads", "1"],
            }
        ],
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
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus missing: `make test` installs Debian's prometheus package")
    key_file = tmp_path / "admin-key"
    key_file.write_text(ADMIN_KEY)
    gateway_address = gateway.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "gateway", "static_configs": [{"targets": [gateway_address]}]},
            {
                "job_name": "engines",
                "http_sd_configs": [
                    {
                        "url": f"{gateway.url}/admin/prometheus/targets",
                        "refresh_interval": "1s",
                        "authorization": {"type": "Bearer", "credentials_file": str(key_file)},
                    }
                ],
            },
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while http_get_status(url + "/-/ready") != 200:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not get ready"
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def http_get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status
    except OSError:  # refused while starting, or an HTTP error status
        return 0


def promql(prometheus: str, query: str) -> dict:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    status, body = http_get(url, timeout=5)
    assert status == 200 and body["status"] == "success", (query, status, body)
    return body["data"]


def chat(gateway_url: str, stream: bool) -> None:
    host, port = gateway_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 4,
        "stream": stream,
    }
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, data
    if stream:
        assert data.rstrip().endswith(b"data: [DONE]")
    else:
        assert json.loads(data)["usage"]["completion_tokens"] > 0


def wait_for_value(prometheus: str, query: str, minimum: float, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = promql(prometheus, query)["result"]
        if result and float(result[0]["value"][1]) >= minimum:
            return
        assert time.monotonic() < deadline, f"{query} did not reach {minimum}: {result}"
        time.sleep(0.25)


@pytest.mark.timeout(120)
def test_dashboards_against_a_live_prometheus(gateway: ServeProcess, prometheus: str) -> None:
    gateway.wait_ready(replicas=1, timeout=60)
    for _ in range(REQUESTS_PER_KIND):
        chat(gateway.url, stream=False)
        chat(gateway.url, stream=True)
    total = 2 * REQUESTS_PER_KIND
    # Scraped after the traffic: the gateway's count and the engine's (found through discovery).
    wait_for_value(prometheus, 'sum(modelyard_requests_total{code="200"})', total, 20)
    wait_for_value(prometheus, "sum(vllm:request_success_total)", total, 20)

    engines = promql(prometheus, 'up{job="engines"}')["result"]
    assert len(engines) == 1
    assert engines[0]["value"][1] == "1"
    assert engines[0]["metric"]["model"] == MODEL and engines[0]["metric"]["replica"] == "0"
    assert promql(prometheus, 'up{job="gateway"}')["result"][0]["value"][1] == "1"

    # Every panel shows data: the query is accepted and its metric and label filters match
    # what is exported (a dashboard filtering on a label nobody sets would come back empty).
    # Series born with the traffic need a second scrape before rate() returns anything.
    deadline = time.monotonic() + 15
    while True:
        empty = [q for q in dashboard_queries() if not promql(prometheus, q)["result"]]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert empty == [], "dashboard queries without data"

    present = {
        series["metric"]["__name__"]
        for series in promql(
            prometheus, 'count by (__name__) ({__name__=~"vllm:.+|modelyard_.+"})'
        )["result"]
    }
    wanted = dashboard_metric_names()
    assert len(wanted) > 20  # the extraction found the dashboards' metrics
    assert wanted - present == set(), "dashboards use metrics that nobody exports"
    # The engine's series carry the served name in model_name, as the dashboards filter on it.
    running = promql(prometheus, "vllm:num_requests_running")["result"]
    assert [series["metric"]["model_name"] for series in running] == [MODEL]
