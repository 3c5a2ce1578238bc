"""Residency with real engine processes (``modelyard serve`` over a tiny local Llama): an on-demand
model starts at its first request, parks after its idle TTL (the engine's memory measured before
and after), and wakes at the next request with the same greedy answer from the same process. The
engine's output goes to its replica's log file, not to the gateway's log."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.net import free_port
from common.processes import descendants
from tests.gateway.serve_process import ServeProcess, http_get


def complete(url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def model_info(gateway: ServeProcess, name: str) -> dict:
    status, listing = http_get(gateway.url + "/admin/models")
    assert status == 200
    return next(m for m in listing["models"] if m["name"] == name)


@pytest.fixture
def gateway(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    model = {
        "name": "od",
        "source": str(tiny_llama_dir),
        "device": "cpu",
        "max_model_len": 256,
        "max_num_seqs": 4,
        "kv_cache_memory": "64MiB",
        "engine_args": ["--num-threads", "1"],
        "residency": "on_demand",
        "idle_ttl_s": 1.5,
    }
    document = {"gateway": {"watch_config": False}, "models": [model]}
    process = ServeProcess(document, tmp_path, free_port())
    try:
        yield process
    finally:
        process.stop()


def wait_state(gateway: ServeProcess, name: str, state: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = model_info(gateway, name)
        if info["state"] == state:
            return info
        time.sleep(0.1)
    raise AssertionError(f"{name} not {state} in {timeout}s: {info} {gateway.stderr()}")


def test_on_demand_engine_loads_parks_and_wakes_with_the_same_answer(gateway):
    gateway._wait_until(
        lambda: http_get(gateway.url + "/health", timeout=0.5)[0] == 200, 20, 0.1, "up"
    )
    assert model_info(gateway, "od")["state"] == "stopped"
    prompts = ["The quick brown fox", "1, 2, 3,"]
    first = [complete(gateway.url, "od", p) for p in prompts]  # the first one waits for the load
    awake = model_info(gateway, "od")
    assert awake["state"] == "ready"
    pid = awake["replicas"][0]["pid"]
    assert pid in descendants(gateway.proc.pid)  # a child of its engine template, or exec'd
    engine_log = Path(awake["replicas"][0]["log"]).read_text()
    assert "loading model" in engine_log and "ready " in engine_log  # the engine's own lines
    assert "loading model" not in gateway.stderr(tail=None)
    parked = wait_state(gateway, "od", "parked", timeout=30)
    footprint = parked["footprint"]
    assert footprint["source"] == "measured"
    assert footprint["parked_bytes"] < footprint["awake_bytes"]
    engine = parked["replicas"][0]["url"]
    status, engine_status = http_get(engine + "/status")
    assert status == 200 and engine_status["sleeping"] is True
    assert engine_status["startup"]["stage"] == "ready"
    assert engine_status["memory"]["kv_cache_bytes"] == 0
    assert [complete(gateway.url, "od", p) for p in prompts] == first  # woken: same answers
    woken = model_info(gateway, "od")
    assert woken["state"] == "ready" and woken["replicas"][0]["pid"] == pid
