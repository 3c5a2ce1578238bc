"""``modelyard serve`` with a fleet of fake engines: engines die with a SIGKILLed gateway, are
drained in order on SIGTERM, and are listed for Prometheus' HTTP service discovery."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import processes
from common.net import free_port
from tests.gateway.serve_process import FAKE_ENGINE, ServeProcess, http_get

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's"
)


def fake_fleet(tmp_path: Path, replicas: int) -> dict:
    source = tmp_path / "fake.gguf"
    source.write_bytes(b"GGUF")
    return {
        "gateway": {"watch_config": False, "health": {"interval_s": 0.2}},
        "models": [{"name": "fake", "source": str(source), "replicas": replicas}],
    }


@pytest.fixture
def serve(tmp_path: Path) -> Iterator:
    started: list[ServeProcess] = []

    def start(replicas: int = 2) -> ServeProcess:
        gateway = ServeProcess(
            fake_fleet(tmp_path, replicas), tmp_path, free_port(), engine_command=FAKE_ENGINE
        )
        started.append(gateway)
        gateway.wait_ready(replicas, timeout=20)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while (alive := {pid for pid in pids if processes.alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_engines_die_with_a_sigkilled_gateway(serve) -> None:
    gateway = serve(replicas=2)
    engines = set(gateway.engine_pids)
    assert len(engines) == 2 and all(processes.alive(pid) for pid in engines)
    gateway.proc.send_signal(signal.SIGKILL)
    gateway.proc.wait(timeout=5)
    assert wait_gone(engines, timeout=5) == set(), "engines outlived the gateway"


def test_sigterm_still_drains_engines_in_order(serve) -> None:
    gateway = serve(replicas=1)
    engines = set(gateway.engine_pids)
    gateway.proc.send_signal(signal.SIGTERM)
    assert gateway.proc.wait(timeout=20) == 0
    assert wait_gone(engines, timeout=1) == set()
    assert "Traceback" not in gateway.stderr()


def test_prometheus_targets_list_the_running_engines(serve) -> None:
    gateway = serve(replicas=2)
    status, groups = http_get(gateway.url + "/admin/prometheus/targets")
    assert status == 200  # open mode without an admin key: loopback clients may read it
    assert sorted(g["labels"]["replica"] for g in groups) == ["0", "1"]
    assert {g["labels"]["model"] for g in groups} == {"fake"}
    for group in groups:
        (target,) = group["targets"]
        # Each target is a live engine of this fleet.
        status, models = http_get(f"http://{target}/v1/models")
        assert status == 200 and models["data"][0]["id"] == "fake"
