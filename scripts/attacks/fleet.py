"""The fleet under attack: `modelyard serve` from a checkout with one SmolLM2 replica, and the
engine it spawns (found through the gateway's Prometheus targets and /proc)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from common.net import free_port
from scripts.attacks.procfs import children, find_engine_pid, proc_alive, proc_cmdline

MODEL = "smollm2"
MAX_NUM_SEQS = 8
ENGINE_GONE_S = 10.0


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def checkout_state(repo: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        cmd = ["git", "--no-optional-locks", "-C", str(repo), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "--short", "HEAD"), "changed_files": len(changed.split())}


class Fleet:
    """`modelyard serve` from ``repo`` (cwd and PYTHONPATH, so that its code imports, not the
    venv's editable install), and the engine it spawns."""

    def __init__(self, repo: Path, workdir: Path, model: Path) -> None:
        self.repo, self.workdir, self.model = repo, workdir, model
        self.env = dict(os.environ, PYTHONPATH=str(repo))
        self.log = workdir / "gateway.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.engine_url = ""
        self.engine_pid: int | None = None
        self.engine_pids_seen: set[int] = set()

    def imports(self) -> dict[str, str]:
        code = (
            "import engine, gateway, json; print(json.dumps([engine.__file__, gateway.__file__]))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=self.repo,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        engine_file, gateway_file = json.loads(out)
        for path in (engine_file, gateway_file):
            if not Path(path).resolve().is_relative_to(self.repo):
                raise RuntimeError(f"{path} imports instead of the code in {self.repo}")
        return {"engine.__file__": engine_file, "gateway.__file__": gateway_file}

    def start(self, ready_timeout: float) -> None:
        config = self.workdir / "models.yaml"
        model = {
            "name": MODEL,
            "source": str(self.model),
            "replicas": 1,
            "kv_cache_memory": "256MiB",
            "max_num_seqs": MAX_NUM_SEQS,
        }
        gateway = {"access_log": False, "watch_config": False}
        config.write_text(json.dumps({"gateway": gateway, "models": [model]}, indent=2))  # YAML
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(config), "--port", str(port)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.repo, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + ready_timeout
        engine_seen = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}; see {self.log}")
            if children(self.proc.pid):
                engine_seen = time.monotonic()
            elif time.monotonic() - engine_seen > ENGINE_GONE_S:  # a failed first start is final
                raise RuntimeError(f"the engine exited before it was ready; see {self.log}")
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                urllib.request.urlopen(self.url + "/ready", timeout=2).read()
                self.refresh()
                return
            time.sleep(0.5)
        raise RuntimeError(f"gateway not ready after {ready_timeout} s; see {self.log}")

    def refresh(self) -> None:
        """The engine's address (it changes if the gateway restarted it) and PID."""
        groups = get_json(self.url + "/admin/prometheus/targets")
        address = next(g["targets"][0] for g in groups if g["labels"].get("kind") == "local")
        pid = find_engine_pid(self.proc.pid, int(address.rsplit(":", 1)[1]))
        if pid is None:
            raise RuntimeError(f"no engine process for {address} under PID {self.proc.pid}")
        self.engine_url, self.engine_pid = f"http://{address}", pid
        self.engine_pids_seen.add(pid)

    def pids(self) -> dict[str, int]:
        pids = {"gateway": self.proc.pid} if self.proc else {}
        if self.engine_pid:
            pids["engine"] = self.engine_pid
        return pids

    def stop(self) -> dict[str, Any]:
        """SIGTERM to the gateway (it stops its engines); then any engine still there, by PID."""
        if self.proc is None:
            return {}
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(map(proc_alive, self.engine_pids_seen)):
            time.sleep(0.2)
        left = [pid for pid in self.engine_pids_seen if proc_alive(pid)]
        for pid in left:
            if "engine" in proc_cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        return {"gateway_exit_code": self.proc.returncode, "engines_left_and_killed": left}
