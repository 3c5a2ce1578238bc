#!/usr/bin/env python
"""The Grafana dashboards drawn as PNGs from a short live run of their own, for `make bench`.

`modelyard serve` with the model pinned and the same file on demand (loaded by its first request,
parked when idle and woken again, so that the residency panels have something to show), a
Prometheus of its own scraping the gateway and the engines it discovers through the gateway
(scripts/live_prometheus.py), rounds of chat requests at rising concurrency, then
scripts/render_dashboards.py over the run.

    python scripts/bench_dashboards.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out bench-results/dashboards

Every round is bounded by a request count and --max-seconds. Without a `prometheus` binary it
says so and exits 0 without drawing (`make prometheus` installs Debian's package).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a plain script: make `common` and `scripts` importable
    sys.path.insert(0, str(REPO))

from common.net import free_port  # noqa: E402
from common.processes import alive, descendants, stop_process  # noqa: E402
from scripts import render_dashboards  # noqa: E402
from scripts.bench_gateway import wait_ready  # noqa: E402
from scripts.live_prometheus import chat, running_prometheus, wait_for_value  # noqa: E402

ADMIN_KEY_ENV = "MODELYARD_DASHBOARDS_ADMIN_KEY"
IDLE_TTL_S = 5.0  # the on-demand copy parks after this long without requests
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
ROUNDS = [(1, 8), (4, 24), (8, 32), (2, 8)]  # (concurrency, requests) to the pinned model


def fleet(model: Path, name: str) -> dict[str, Any]:
    """models.yaml: ``name`` pinned, ``name``-od on demand; the admin key for discovery."""
    pinned = {
        "name": name,
        "source": str(model.resolve()),
        "kv_cache_memory": "256MiB",
        "max_num_seqs": 8,
    }
    on_demand = {**pinned, "name": f"{name}-od", "residency": "on_demand", "idle_ttl_s": IDLE_TTL_S}
    gateway = {"watch_config": False, "access_log": False, "auth": {"admin_key_env": ADMIN_KEY_ENV}}
    return {"gateway": gateway, "models": [pinned, on_demand]}


@contextlib.contextmanager
def running_gateway(document: dict, workdir: Path, admin_key: str) -> Iterator[str]:
    """`modelyard serve` from this checkout on a free port, serving; its URL. Stopped after,
    with any engine it leaves behind."""
    config = workdir / "models.yaml"
    config.write_text(json.dumps(document, indent=2))  # JSON is YAML
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config), "--port", str(port)]
    env = {**os.environ, ADMIN_KEY_ENV: admin_key}
    log_path = workdir / "gateway.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        try:
            wait_ready(f"http://127.0.0.1:{port}/ready", proc, START_TIMEOUT_S)
        except RuntimeError as exc:  # the log goes with the temporary folder: show it now
            raise RuntimeError(f"{exc}\n{log_path.read_text(errors='replace')[-3000:]}") from exc
        yield f"http://127.0.0.1:{port}"
    finally:
        engines = descendants(proc.pid)
        stop_process(proc, STOP_TIMEOUT_S)
        for pid in engines:
            if alive(pid):  # the gateway stops its engines; this is the safety net
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def round_of_chats(
    url: str, model: str, concurrency: int, count: int, max_tokens: int, max_seconds: float
) -> int:
    """``count`` chats (every other one streamed) at ``concurrency``, none started after
    ``max_seconds``; how many were answered (a failure is printed, and shows on the dashboards)."""
    deadline = time.monotonic() + max_seconds

    def one(i: int) -> bool:
        if time.monotonic() > deadline:
            return False
        chat(url, model, stream=i % 2 == 1, max_tokens=max_tokens)
        return True

    answered = 0
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(one, i) for i in range(count)]:
            try:
                answered += future.result()
            except (OSError, RuntimeError) as exc:
                print(f"bench_dashboards: {exc}", file=sys.stderr)
    return answered


def traffic(gateway: str, prometheus: str, name: str, args: argparse.Namespace) -> int:
    """The pinned model's rounds, with the on-demand copy's cold start before them and its wake
    after (it parks between); how many requests were answered."""

    def chats(model: str, concurrency: int, count: int) -> int:
        return round_of_chats(gateway, model, concurrency, count, args.max_tokens, args.max_seconds)

    on_demand = f"{name}-od"
    answered = chats(on_demand, 1, 1)  # held while it starts
    answered += sum(chats(name, concurrency, count) for concurrency, count in ROUNDS[:2])
    parked = f'max(modelyard_replica_state{{model="{on_demand}", state="parked"}})'
    wait_for_value(prometheus, parked, 1, IDLE_TTL_S + 30)
    answered += sum(chats(name, concurrency, count) for concurrency, count in ROUNDS[2:])
    return answered + chats(on_demand, 1, 1)  # held while it wakes


def run(args: argparse.Namespace) -> int:
    admin_key = secrets.token_urlsafe(24)
    name = args.served_model_name
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="modelyard-dash-")))
        gateway = stack.enter_context(running_gateway(fleet(args.model, name), workdir, admin_key))
        prometheus = stack.enter_context(running_prometheus(workdir, gateway, admin_key))
        since = time.time()
        # Both targets scraped before the first request: rate() sees every series' first event.
        wait_for_value(prometheus, "sum(up)", 2, 30)
        answered = traffic(gateway, prometheus, name, args)
        # Drawn once Prometheus has scraped the last answers, and once more for rate().
        wait_for_value(prometheus, 'sum(modelyard_requests_total{code="200"})', answered, 30)
        time.sleep(2)
        argv = ["--prometheus", prometheus, "--start", str(since), "--out", str(args.out)]
        return render_dashboards.main(argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a GGUF file or model folder")
    parser.add_argument("--served-model-name", default="smollm2")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-seconds", type=float, default=20.0, help="per round")
    args = parser.parse_args()
    if shutil.which("prometheus") is None:
        print(
            "bench_dashboards: no dashboards drawn: prometheus is not installed "
            "(`make prometheus` installs Debian's package)",
            file=sys.stderr,
        )
        return
    sys.exit(run(args))


if __name__ == "__main__":
    main()
