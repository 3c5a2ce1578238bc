"""The engine as a process: the queue limit's 503s then a graceful SIGTERM (exit 0), streams
ended in band past the grace period, the CLI's help and one-line errors, a dead loop's non-zero
exit, and the --max-header-bytes limit."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.engine.server_http import CHAT, chat_body, post
from tests.raw_http import assert_openai_error, raw_exchange
from tests.server_utils import REPO_ROOT, EngineProcess

pytestmark = pytest.mark.timeout(240)


async def test_queue_limit_503_then_sigterm_finishes_in_flight_and_exits_0(tiny_llama_dir):
    flags = (
        "--kv-cache-memory",
        "16MiB",
        "--max-num-seqs",
        "1",
        "--max-queue",
        "1",
        "--max-body-bytes",
        "2048",
        "--num-threads",
        "1",
    )
    proc = EngineProcess(tiny_llama_dir, *flags).wait_ready()
    try:
        body = chat_body("Hello", max_tokens=80, ignore_eos=True, stream=True)
        short = chat_body("Hello", max_tokens=2)
        async with aiohttp.ClientSession() as session:
            async with session.post(proc.url + CHAT, json=body) as reply:
                for _ in range(3):  # role chunk, blank line, first token: it is running now
                    await reply.content.readline()
                # one running (max-num-seqs 1) and one waiting (max-queue 1): the rest are shed
                tasks = [asyncio.ensure_future(post(proc.url + CHAT, short)) for _ in range(4)]
                deadline = time.monotonic() + 20
                while sum(task.done() for task in tasks) < 3:
                    assert time.monotonic() < deadline, "expected 3 requests shed at once"
                    await asyncio.sleep(0.01)
                shed = [task.result() for task in tasks if task.done()]
                assert all(status == 503 for status, _ in shed), shed
                assert all(body["error"]["code"] == "overloaded" for _, body in shed)
                status, payload = await post(proc.url + CHAT, chat_body("x" * 3000))
                assert status == 413 and payload["error"]["code"] == "body_too_large"
                proc.proc.send_signal(subprocess.signal.SIGTERM)
                rest = await reply.content.read()
                # the queued request was in flight at SIGTERM: it still completes
                statuses = sorted(status for status, _ in await asyncio.gather(*tasks))
                assert statuses == [200, 503, 503, 503], [r for r in (t.result() for t in tasks)]
            assert rest.rstrip().endswith(b"data: [DONE]")
            assert b'"finish_reason": "length"' in rest
        code = await asyncio.get_running_loop().run_in_executor(None, proc.proc.wait, 30)
        assert code == 0, proc.log()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as session:
                await session.get(proc.url + "/health")
    finally:
        proc.stop()


async def test_sigterm_past_the_grace_period_ends_streams_in_band(tiny_llama_dir):
    flags = ("--kv-cache-memory", "16MiB", "--shutdown-timeout", "1", "--num-threads", "1")
    proc = EngineProcess(tiny_llama_dir, *flags).wait_ready()
    try:
        # 16 choices of ~1000 tokens: more work than the tiny model finishes within the 1 s grace
        body = chat_body("Hello", max_tokens=1000, n=16, ignore_eos=True, stream=True)
        async with aiohttp.ClientSession() as session:
            async with session.post(proc.url + CHAT, json=body) as reply:
                await reply.content.readline()
                proc.proc.send_signal(subprocess.signal.SIGTERM)
                started = time.monotonic()
                rest = await reply.content.read()
            code = await asyncio.get_running_loop().run_in_executor(None, proc.proc.wait, 30)
            elapsed = time.monotonic() - started
        assert code == 0, proc.log()
        assert b'"code": "shutting_down"' in rest and rest.rstrip().endswith(b"data: [DONE]")
        assert elapsed < 10, f"exit took {elapsed:.1f} s with a 1 s grace period"
    finally:
        proc.stop()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_help_has_one_line_per_flag():
    result = run_cli("--help")
    assert result.returncode == 0
    options = result.stdout.split("options:", 1)[1].splitlines()[1:]
    flag_lines = {line.split()[0]: line for line in options if line.startswith("  --")}
    for line in flag_lines.values():  # flag, then its help, on the same line
        assert re.match(r"\s+--\S+( \S+)*\s{2,}\S", line), line
    for flag in (
        "--model",
        "--served-model-name",
        "--port",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--kv-cache-memory",
        "--gpu-memory-fraction",
        "--dtype",
        "--kv-cache-dtype",
        "--device",
        "--seed",
        "--max-queue",
        "--max-header-bytes",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
    ):
        assert flag in flag_lines, flag


@pytest.mark.parametrize(
    "args",
    [
        ("--model", "/nonexistent/model"),
        ("--model", ".", "--max-model-len", "-3"),
        ("--model", ".", "--max-num-seqs", "0"),
        ("--model", ".", "--port", "99999"),
        ("--model", ".", "--kv-cache-memory", "lots"),
        ("--model", ".", "--gpu-memory-fraction", "1.5"),
        ("--model", ".", "--block-size", "12"),
        ("--model", ".", "--dtype", "float64"),
        ("--model", ".", "--kv-cache-dtype", "int4"),
    ],
)
def test_cli_bad_values_one_line_exit_2(args):
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


_FAILING_ENGINE = """
import sys
import engine.core.engine_core
from engine.serving.cli import main

steps = 0
original = engine.core.engine_core.EngineCore.step


def failing_step(self):
    global steps
    steps += 1
    if steps > 3:
        raise RuntimeError("injected step failure")
    return original(self)


engine.core.engine_core.EngineCore.step = failing_step
sys.exit(main(sys.argv[1:]))
"""


async def test_engine_process_exits_nonzero_when_its_loop_dies(tiny_llama_dir, tmp_path):
    """A supervisor (the gateway's pool) restarts engines whose process exits; a dead loop must
    not leave a live process that can never serve again."""
    script = tmp_path / "failing_engine.py"
    script.write_text(_FAILING_ENGINE)
    launcher = (sys.executable, str(script))
    proc = EngineProcess(tiny_llama_dir, "--num-threads", "1", launcher=launcher)
    try:
        proc.wait_ready()
        body = chat_body("Hello", max_tokens=20, ignore_eos=True)
        async with (
            aiohttp.ClientSession() as session,
            session.post(proc.url + CHAT, json=body) as reply,
        ):
            assert reply.status == 500
            assert (await reply.json())["error"]["type"] == "internal_error"
        code = await asyncio.get_running_loop().run_in_executor(None, proc.proc.wait, 30)
        assert code == 1, proc.log()
        assert "engine loop died" in proc.log()
    finally:
        proc.stop()


async def test_max_header_bytes_flag_sets_the_431_limit(tiny_llama_dir):
    proc = EngineProcess(tiny_llama_dir, "--num-threads", "1", "--max-header-bytes", "1KiB")
    try:
        proc.wait_ready()
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1500 + b"\r\n\r\n"
        status, headers, body = await raw_exchange(proc.url, request)
        assert status == 431
        assert_openai_error(headers, body, "request_header_fields_too_large")
        assert "limit of 1024 bytes" in json.loads(body)["error"]["message"]
        async with (
            aiohttp.ClientSession() as session,
            session.get(proc.url + "/health", headers={"X-Small": "a" * 900}) as reply,
        ):
            assert reply.status == 200
    finally:
        proc.stop()
