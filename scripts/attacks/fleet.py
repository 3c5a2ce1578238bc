"""The fleet under attack: `modelyard serve` from a checkout with one SmolLM2 replica (and the
same model on demand, for the residency attacks), the engine it spawns (found through the
gateway's Prometheus targets and /proc), and what an operator does through /admin (with the admin
key the fleet sets): a model's state, a load after a crash loop, an unload and load that replace
a wedged engine."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from common.net import free_port
from common.processes import alive, children, cmdline, descendants, stop_process

MODEL = "smollm2"
ON_DEMAND_MODEL = "smollm2-od"  # the same GGUF, loaded only when an attack asks for it
MAX_NUM_SEQS = 8
ENGINE_GONE_S = 10.0
ADMIN_KEY_ENV = "MODELYARD_ATTACKS_ADMIN_KEY"
ADMIN_TIMEOUT_S = 180.0
SETTLED = ("ready", "parked", "failed", "stopped")  # model states nothing is changing
SETTLED_FOR_S = 2.0


def get_json(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def checkout_state(repo: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        cmd = ["git", "--no-optional-locks", "-C", str(repo), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "--short", "HEAD"), "changed_files": len(changed.split())}


def find_engine_pid(gateway_pid: int, port: int) -> int | None:
    """The engine listening on ``port``: a descendant of the gateway (its launcher execs it)."""
    for pid in descendants(gateway_pid):
        cmd = cmdline(pid)
        if "engine" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port):
            return pid
    return None


class Fleet:
    """`modelyard serve` from ``repo`` (cwd and PYTHONPATH, so that its code imports, not the
    venv's editable install), and the engine it spawns."""

    def __init__(self, repo: Path, workdir: Path, model: Path) -> None:
        self.repo, self.workdir, self.model = repo, workdir, model
        admin_key = secrets.token_urlsafe(24)
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"}
        self.env = dict(os.environ, PYTHONPATH=str(repo), **{ADMIN_KEY_ENV: admin_key})
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
        on_demand = {
            **model,
            "name": ON_DEMAND_MODEL,
            "residency": "on_demand",
            "idle_ttl_s": 3600,  # parked and loaded by the attacks, never by the sweeper
        }
        gateway = {
            "access_log": False,
            "watch_config": False,
            "auth": {"admin_key_env": ADMIN_KEY_ENV},  # clients stay in open mode
        }
        document = {"gateway": gateway, "models": [model, on_demand]}
        config.write_text(json.dumps(document, indent=2))  # JSON is YAML
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
        groups = get_json(self.url + "/admin/prometheus/targets", headers=self.admin_headers)
        address = next(
            g["targets"][0]
            for g in groups
            if g["labels"].get("kind") == "local" and g["labels"].get("model") == MODEL
        )
        pid = find_engine_pid(self.proc.pid, int(address.rsplit(":", 1)[1]))
        if pid is None:
            raise RuntimeError(f"no engine process for {address} under PID {self.proc.pid}")
        self.engine_url, self.engine_pid = f"http://{address}", pid
        self.engine_pids_seen.add(pid)

    def admin(
        self, method: str, path: str, timeout: float = ADMIN_TIMEOUT_S
    ) -> tuple[int | None, Any]:
        """One /admin request with the admin key: (status, JSON body), or (None, the error)."""
        request = urllib.request.Request(
            self.url + path,
            method=method,
            headers=self.admin_headers,
            data=b"" if method == "POST" else None,
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            with contextlib.suppress(ValueError):
                return exc.code, json.loads(exc.read())
            return exc.code, None
        except (OSError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def model_status(self, name: str = MODEL) -> dict[str, Any]:
        """The model's state in /admin/models, its replicas' PIDs and restarts added up, its
        held requests; state "unknown" when the gateway does not say."""
        status, body = self.admin("GET", "/admin/models", timeout=10)
        models = body.get("models", []) if status == 200 and isinstance(body, dict) else []
        entry = next((m for m in models if m.get("name") == name), None)
        if entry is None:
            return {"state": "unknown", "pid": None, "restarts": None, "held": None}
        replicas = entry.get("replicas", [])
        return {
            "state": entry.get("state"),
            "pid": next((r.get("pid") for r in replicas if r.get("pid")), None),
            "restarts": sum(r.get("restarts", 0) for r in replicas),
            "held": entry.get("queued_requests"),
        }

    def wait_settled(self, name: str, timeout: float) -> dict[str, Any]:
        """The model's status once it has held a state nothing changes for SETTLED_FOR_S (a
        stopped model the gateway restarts at once is not settled), or after ``timeout``; and
        how long that took."""
        t0 = time.monotonic()
        status, since = self.model_status(name), t0
        while time.monotonic() < t0 + timeout:
            if status["state"] in SETTLED and time.monotonic() - since >= SETTLED_FOR_S:
                break
            time.sleep(0.5)
            now = self.model_status(name)
            if now["state"] != status["state"]:
                since = time.monotonic()
            status = now
        return {**status, "settled_after_s": round(time.monotonic() - t0, 1)}

    def recover(self, timeout: float) -> str:
        """Waits (up to ``timeout``) for MODEL to be ready, with an operator's load when it is
        failed or stopped; refreshes the engine's address. Says what it took."""
        deadline = time.monotonic() + timeout
        loaded = False
        while time.monotonic() < deadline:
            state = self.model_status()["state"]
            if state == "ready":
                with contextlib.suppress(OSError, RuntimeError, ValueError, StopIteration):
                    self.refresh()
                    return "ready after a load" if loaded else "ready"
            elif state in ("failed", "stopped") and not loaded:
                loaded = True
                self.admin("POST", f"/admin/models/{MODEL}/load", deadline - time.monotonic())
                continue
            time.sleep(0.5)
        return f"not ready after {timeout:g} s ({self.model_status()['state']})"

    def reset(self, timeout: float) -> str:
        """A fresh engine for MODEL: unload (drain, SIGTERM, SIGKILL after the pool's stop
        timeout) and load, as an operator replaces a wedged one."""
        status, _ = self.admin("POST", f"/admin/models/{MODEL}/unload", timeout)
        return f"unload {status}; " + self.recover(timeout)

    def pids(self) -> dict[str, int]:
        pids = {"gateway": self.proc.pid} if self.proc else {}
        if self.engine_pid:
            pids["engine"] = self.engine_pid
        return pids

    def stop(self) -> dict[str, Any]:
        """SIGTERM to the gateway (it stops its engines); then any engine still there, by PID."""
        if self.proc is None:
            return {}
        stop_process(self.proc, 60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(map(alive, self.engine_pids_seen)):
            time.sleep(0.2)
        left = [pid for pid in self.engine_pids_seen if alive(pid)]
        for pid in left:
            if "engine" in cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        return {"gateway_exit_code": self.proc.returncode, "engines_left_and_killed": left}
