"""A real Prometheus scraping a running gateway and its engines (found through the gateway's
service discovery, with the admin key, as docs/OPERATIONS.md sets it up), and chat requests to
give it something to see: for tests/test_observability.py and scripts/bench_dashboards.py."""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from common.net import free_port
from common.processes import stop_process

READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0


def scrape_config(gateway_url: str, key_file: Path, interval: str) -> dict[str, Any]:
    """The gateway statically, its engines through /admin/prometheus/targets."""
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": "gateway",
                "static_configs": [{"targets": [gateway_url.removeprefix("http://")]}],
            },
            {
                "job_name": "engines",
                "http_sd_configs": [
                    {
                        "url": f"{gateway_url}/admin/prometheus/targets",
                        "refresh_interval": interval,
                        "authorization": {"type": "Bearer", "credentials_file": str(key_file)},
                    }
                ],
            },
        ],
    }


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return reply.status
    except OSError:  # refused while starting, or an HTTP error status
        return 0


@contextlib.contextmanager
def running_prometheus(
    workdir: Path, gateway_url: str, admin_key: str, interval: str = "1s"
) -> Iterator[str]:
    """Prometheus on a free loopback port, its TSDB and log in ``workdir``, ready; its URL.
    FileNotFoundError without a ``prometheus`` binary, RuntimeError if it will not start."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise FileNotFoundError("prometheus is not installed (`make prometheus`: Debian's package)")
    key_file = workdir / "admin-key"
    key_file.write_text(admin_key)
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(scrape_config(gateway_url, key_file, interval)))
    port = free_port()
    log_path = workdir / "prometheus.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=log,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while http_status(url + "/-/ready") != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        stop_process(proc, STOP_TIMEOUT_S)


def instant_query(prometheus: str, query: str) -> dict[str, Any]:
    """``data`` of /api/v1/query; RuntimeError when Prometheus refuses the query."""
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        body = {"status": f"HTTP {exc.code}", "error": exc.read()[:500]}
    if body.get("status") != "success":
        raise RuntimeError(f"{query}: {body}")
    return body["data"]


def wait_for_value(prometheus: str, query: str, minimum: float, timeout: float) -> None:
    """Until the query's first series is at least ``minimum``; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = instant_query(prometheus, query)["result"]
        if result and float(result[0]["value"][1]) >= minimum:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{query} did not reach {minimum} in {timeout} s: {result}")
        time.sleep(0.25)


def chat(gateway_url: str, model: str, stream: bool, max_tokens: int, timeout: float = 60) -> None:
    """One chat completion through the gateway; RuntimeError unless it completed."""
    host, port = gateway_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    done = (
        data.rstrip().endswith(b"data: [DONE]")
        if stream
        else reply.status == 200 and json.loads(data)["usage"]["completion_tokens"] > 0
    )
    if reply.status != 200 or not done:
        raise RuntimeError(f"chat to {model}: HTTP {reply.status}: {data[-500:]!r}")
