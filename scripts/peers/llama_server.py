"""llama-server started by the benchmark on a free loopback port, configured like Modelyard's
engine for the same workload, and stopped; and the F16 GGUF it may run beside the file given."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from common.net import free_port
from common.processes import stop_process
from engine.model.cpu.openmp_env import configure
from scripts.serving.engine_server import wait_ready


def f16_model(quantize: Path, source: Path, cache: Path) -> Path:
    """``source`` requantized to F16 by llama-quantize, once. Its weights are the dequantized
    values of the source's blocks, so its outputs match the file's quality: only its speed
    differs. Named after the whole source stem: two quantizations of one model differ."""
    dest = cache / f"{source.stem}.F16.gguf"
    if dest.exists() and dest.stat().st_mtime >= source.stat().st_mtime:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(".partial")
    cmd = [str(quantize), "--allow-requantize", str(source), str(partial), "F16"]
    subprocess.run(cmd, check=True, capture_output=True)
    partial.rename(dest)
    return dest


def openmp_env(engine_flags: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment with the OpenMP wait policy ``python -m engine`` would set for
    itself (PASSIVE unless the environment says otherwise): both servers wait alike. ggml's
    default spinning made llama-server -t 2 on the shared 2-core VM stall for ~3 s at a time
    (C=1: 3.9 tok/s spinning, 22 tok/s passive, 2026-12-02, load average 3-4)."""
    env = dict(os.environ)
    configure(engine_flags, env)
    return env


def context_size(parallel: int, prompt_tokens: int, output_tokens: int) -> int:
    """One unified KV cache (--kv-unified) holding ``parallel`` full sequences."""
    return parallel * (prompt_tokens + output_tokens)


def server_command(
    binary: Path, model: Path, name: str, port: int, threads: int, parallel: int, ctx: int
) -> list[str]:
    # Prompt caches off (--cache-ram 0): the workload never repeats a prompt, and an 8 GiB host
    # cache would only inflate the RSS. One HTTP thread per slot and a few to spare, so no
    # request waits for a thread; no web UI.
    return [
        str(binary),
        "--model", str(model),
        "--alias", name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--parallel", str(parallel),
        "--ctx-size", str(ctx),
        "--kv-unified",
        "--cont-batching",
        "--cache-ram", "0",
        "--threads-http", str(parallel + 4),
        "--no-webui",
    ]  # fmt: skip


class LlamaServer:
    """A llama-server process; ``pid`` for its RSS, ``url`` for the load generator."""

    def __init__(self, command: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.command = command
        self._log = open(log_path, "wb")  # noqa: SIM115 (open for the process lifetime)
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid

    @classmethod
    def start(
        cls, binary: Path, model: Path, name: str, threads: int, parallel: int, ctx: int, log: Path,
        env: dict[str, str], extra_flags: Sequence[str] = (),
    ) -> LlamaServer:  # fmt: skip
        port = free_port()
        command = [*server_command(binary, model, name, port, threads, parallel, ctx), *extra_flags]
        return cls(command, port, log, env)

    def wait_ready(self, timeout: float) -> None:
        """/health answers 503 while the model loads, 200 once it serves."""
        wait_ready(self.proc, self.url + "/health", "llama-server", timeout)

    def stop(self) -> int | None:
        stop_process(self.proc, 30)
        self._log.close()
        return self.proc.returncode


def version(binary: Path) -> str | None:
    """llama-server's own build line (``--version`` prints it on stderr)."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if "version" in ln.lower()]
    return lines[0].strip() if lines else None
