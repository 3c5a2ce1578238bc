"""``modelyard ps`` against a real gateway process with fake engines (tests/gateway/fake_engine.py)
and an external mock upstream: its table and ``--json`` rows checked value for value against
``GET /admin/models`` while requests run and wait; its one-line errors for a gateway that is down,
does not answer, refuses the key or is not a gateway; ``--watch``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from common.net import free_port
from common.sizes import format_size
from gateway.cli import main
from gateway.ps.rows import KEYS
from gateway.ps.rows import rows as ps_rows
from gateway.ps.table import duration
from scripts.mock_upstream import MockUpstream
from tests.gateway.serve_process import FAKE_ENGINE, REPO_ROOT, ServeProcess, http_get

MiB = 2**20
ADMIN = "sk-ps-test-admin"
KEY_ENV = "PS_TEST_ADMIN_KEY"
CHAT_TOKENS = 3 * 5  # three answers of 5 tokens
OD_TOKENS = 6


class Fleet:
    def __init__(self, gateway: ServeProcess, upstream: MockUpstream) -> None:
        self.gateway = gateway
        self.upstream = upstream
        self.url = gateway.url

    def admin(self) -> dict[str, Any]:
        status, listing = http_get(self.url + "/admin/models", token=ADMIN)
        assert status == 200
        return listing

    def model(self, name: str) -> dict[str, Any]:
        return next(m for m in self.admin()["models"] if m["name"] == name)


def post(url: str, model: str, timeout: float = 30, **mock: Any) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    body.update(mock.pop("body", {}))
    body["mock"] = mock
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        resp.read()


def in_background(url: str, model: str, **mock: Any) -> None:
    """A request left running (or queued) while the test looks; it ends with the gateway at the
    latest."""

    def send() -> None:
        with contextlib.suppress(OSError):
            post(url, model, timeout=20, **mock)

    threading.Thread(target=send, daemon=True).start()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """chat: pinned, 2 replicas, measured at 300 MiB each; od: on demand, loaded by a request
    (measured 200 MiB, idle TTL 120 s); slow: on demand, its load takes 8 s; lazy: on demand,
    never asked for; ext: an external upstream. Budget 8 GiB."""
    folder = tmp_path_factory.mktemp("ps")
    source = folder / "tiny.gguf"
    source.write_bytes(b"GGUF")
    upstream = MockUpstream("ext").start()
    rss = ["--rss-bytes", str(300 * MiB)]
    od_rss = ["--rss-bytes", str(200 * MiB), "--parked-rss-bytes", str(50 * MiB)]
    models = [
        {"name": "chat", "aliases": ["default", "c"], "replicas": 2, "engine_args": rss},
        {"name": "od", "residency": "on_demand", "idle_ttl_s": 120, "engine_args": od_rss},
        {"name": "slow", "residency": "on_demand", "engine_args": ["--ready-delay-s", "8"]},
        {"name": "lazy", "residency": "on_demand"},
    ]
    document = {
        "gateway": {
            "watch_config": False,
            "health": {"interval_s": 0.2, "timeout_s": 2.0},
            "auth": {"admin_key_env": KEY_ENV},
            "memory": {"cpu_bytes": "8GiB"},
        },
        "models": [
            *({"source": str(source), "memory_estimate": "1GiB", **m} for m in models),
            {"name": "ext", "upstreams": [upstream.url]},
        ],
    }
    gateway = ServeProcess(
        document, folder, free_port(), FAKE_ENGINE, env={KEY_ENV: ADMIN}, admin_key=ADMIN
    )
    fleet = Fleet(gateway, upstream)
    try:
        gateway._wait_until(
            lambda: (
                all(r["measured_bytes"] for r in fleet.model("chat")["replicas"])
                and len(fleet.model("chat")["replicas"]) == 2
            ),
            30,
            0.1,
            "serving chat",
        )
        for _ in range(3):
            post(fleet.url, "c")
        post(fleet.url, "od", body={"max_tokens": OD_TOKENS})
        gateway._wait_until(
            lambda: fleet.model("od")["replicas"][0]["measured_bytes"], 10, 0.1, "od measured"
        )
        yield fleet
    finally:
        gateway.stop()
        upstream.stop()


def ps(*args: str, key: str | None = ADMIN, url: str | None = None) -> subprocess.CompletedProcess:
    """``modelyard ps`` as a process, with the admin key in $MODELYARD_ADMIN_KEY."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODELYARD_ADMIN_KEY", "MODELYARD_URL")}
    if key is not None:
        env["MODELYARD_ADMIN_KEY"] = key
    command = [sys.executable, "-m", "gateway.cli", "ps", *args]
    if url:
        command += ["--url", url]
    return subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=30
    )


def parse_table(text: str) -> tuple[str, list[dict[str, str]]]:
    """The budget line, and the rows as {header: cell} (cells never hold two spaces in a row)."""
    budget, header, *lines = text.splitlines()
    columns = re.split(r" {2,}", header.strip())
    rows = [dict(zip(columns, re.split(r" {2,}", line.strip()), strict=True)) for line in lines]
    return budget, rows


def seconds(cell: str) -> int:
    """A duration cell (45s, 3m12s, 1h02m, 2d03h) back in seconds, to its precision."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([dhms])", cell))


def busy(fleet: Fleet) -> None:
    """A chat request running (4 s) and a slow request queued while slow loads (8 s)."""
    in_background(fleet.url, "chat", delay_ms=4000)
    in_background(fleet.url, "slow")
    fleet.gateway._wait_until(
        lambda: (
            fleet.model("chat")["in_flight"] == 1 and fleet.model("slow")["queued_requests"] == 1
        ),
        10,
        0.05,
        "busy",
    )


def test_table_shows_what_the_admin_api_says(fleet: Fleet):
    busy(fleet)
    result = ps(url=fleet.url)
    listing = fleet.admin()  # after ps: idle and up times have only grown since
    assert result.returncode == 0, result.stderr
    budget_line, rows = parse_table(result.stdout)
    memory = listing["memory"]
    used, total = memory["cpu_resident_bytes"], memory["cpu_bytes"]
    assert budget_line == (
        f"{fleet.url}  memory {format_size(used)} of 8.0 GiB ({100 * used / total:.0f}%)"
    )
    by_name = {row["NAME"]: row for row in rows}
    assert [row["NAME"] for row in rows] == [
        "chat", "chat#0", "chat#1", "od", "od#0", "slow", "slow#0", "lazy", "ext",
    ]  # fmt: skip
    models = {m["name"]: m for m in listing["models"]}
    chat = models["chat"]
    assert by_name["chat"] | {"UP": ""} == {
        "NAME": "chat", "ALIASES": "default,c", "STATE": "ready", "RESIDENCY": "pinned",
        "PID": "-", "MEMORY": "600 MiB", "RUN": "1", "QUEUED": "0",
        "TOK/S": f"{CHAT_TOKENS / 60:.1f}", "IDLE": "-", "PARKS IN": "-", "UP": "", "RESTARTS": "0",
    }  # fmt: skip
    assert chat["resident_bytes"] == 600 * MiB and chat["footprint"]["source"] == "measured"
    assert chat["completion_tokens_per_s"] == pytest.approx(CHAT_TOKENS / 60, abs=1e-3)
    for replica in chat["replicas"]:
        row = by_name[f"chat#{replica['index']}"]
        assert (row["STATE"], row["PID"], row["MEMORY"]) == (
            "ready",
            str(replica["pid"]),
            "300 MiB",
        )
        assert row["RUN"] == str(replica["in_flight"])
        assert (row["ALIASES"], row["QUEUED"], row["TOK/S"], row["IDLE"]) == ("-", "-", "-", "-")
        assert seconds(row["UP"]) <= replica["uptime_s"] < seconds(row["UP"]) + 3  # 0s: <1 s up
    assert sorted(r["in_flight"] for r in chat["replicas"]) == [0, 1]
    assert seconds(by_name["chat"]["UP"]) == max(
        seconds(by_name[f"chat#{i}"]["UP"]) for i in (0, 1)
    )
    od = models["od"]
    assert (by_name["od"]["STATE"], by_name["od"]["MEMORY"]) == ("ready", "200 MiB")
    assert by_name["od"]["RESIDENCY"] == "on_demand"
    assert by_name["od"]["TOK/S"] == f"{OD_TOKENS / 60:.1f}"
    assert seconds(by_name["od"]["IDLE"]) <= od["idle_s"] < seconds(by_name["od"]["IDLE"]) + 3
    ttl_left = seconds(by_name["od"]["PARKS IN"])
    assert od["ttl_left_s"] <= ttl_left + 1 and ttl_left < od["ttl_left_s"] + 3
    assert od["ttl_left_s"] == pytest.approx(120 - od["idle_s"], abs=0.01)
    slow = models["slow"]
    assert [by_name["slow"][c] for c in ("STATE", "RUN", "QUEUED", "IDLE")] == [
        "starting",
        "0",
        "1",
        "-",
    ]
    assert by_name["slow"]["MEMORY"] == "~1.0 GiB"  # its estimate, held for its load
    assert slow["footprint"]["source"] == "estimated" and slow["ttl_left_s"] is None
    assert (by_name["slow#0"]["STATE"], by_name["slow#0"]["MEMORY"]) == ("starting", "-")
    assert (by_name["lazy"]["STATE"], by_name["lazy"]["MEMORY"], by_name["lazy"]["UP"]) == (
        "stopped", "-", "-",
    )  # fmt: skip
    assert by_name["ext"] | {"TOK/S": ""} == {
        "NAME": "ext", "ALIASES": "-", "STATE": "ready", "RESIDENCY": "external", "PID": "-",
        "MEMORY": "-", "RUN": "0", "QUEUED": "0", "TOK/S": "", "IDLE": "-", "PARKS IN": "-",
        "UP": "-", "RESTARTS": "-",
    }  # fmt: skip
    assert ADMIN not in result.stdout + result.stderr


def expected_rows(listing: dict[str, Any]) -> list[tuple]:
    """What the rows must say of each model and replica, from an /admin/models answer (the
    figures that do not move by themselves, as times do)."""
    expected: list[tuple] = []
    for m in listing["models"]:
        replicas = m.get("replicas", [])
        restarts = sum(r["restarts"] for r in replicas) if m["local"] else None
        source = m["footprint"]["source"] if m["local"] else None
        expected.append((
            "model", m["name"], None, m["aliases"], m["state"], m.get("residency", "external"),
            None, m.get("resident_bytes"), source, m["in_flight"], m["queued_requests"],
            m["completion_tokens_per_s"], restarts,
        ))  # fmt: skip
        expected += [
            ("replica", m["name"], r["index"], [], r["state"], None, r["pid"], r["measured_bytes"],
             "measured" if r["measured_bytes"] else None, r["in_flight"], None, None, r["restarts"])
            for r in replicas
        ]  # fmt: skip
    return expected


def test_json_rows_follow_the_schema(fleet: Fleet):
    before = fleet.admin()
    result = ps("--json", url=fleet.url)
    after = fleet.admin()  # a load or a request may end meanwhile: the rows match one of the two
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert isinstance(rows, list) and all(list(row) == list(KEYS) for row in rows)
    types = {
        "kind": str, "model": str, "replica": (int, type(None)), "aliases": list, "state": str,
        "residency": (str, type(None)), "pid": (int, type(None)),
        "memory_bytes": (int, type(None)), "memory_source": (str, type(None)), "running": int,
        "queued": (int, type(None)), "completion_tokens_per_s": (float, type(None)),
        "idle_s": (float, type(None)), "ttl_left_s": (float, type(None)),
        "uptime_s": (float, type(None)), "restarts": (int, type(None)),
    }  # fmt: skip
    for row in rows:
        for key, kind in types.items():
            assert isinstance(row[key], kind), (key, row)
    fixed = ("kind", "model", "replica", "aliases", "state", "residency", "pid",
             "memory_bytes", "memory_source", "running", "queued", "completion_tokens_per_s",
             "restarts")  # fmt: skip
    got = [tuple(row[key] for key in fixed) for row in rows]
    assert got in (expected_rows(before), expected_rows(after))
    chat = rows[0]
    assert (chat["model"], chat["memory_bytes"], chat["residency"]) == ("chat", 600 * MiB, "pinned")
    assert chat["completion_tokens_per_s"] == pytest.approx(CHAT_TOKENS / 60, abs=1e-3)
    assert all(r["uptime_s"] > 0 for r in rows if r["kind"] == "replica" and r["pid"])
    ext = rows[-1]
    assert (ext["model"], ext["residency"], ext["memory_bytes"], ext["queued"]) == (
        "ext", "external", None, 0,
    )  # fmt: skip


def test_watch_shows_frames_until_interrupted(fleet: Fleet):
    env = {**os.environ, "MODELYARD_ADMIN_KEY": ADMIN}
    command = [sys.executable, "-m", "gateway.cli", "ps", "--url", fleet.url, "--json"]
    proc = subprocess.Popen(
        [*command, "--watch", "0.2"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        # Ctrl-C's default: a test run started in the background (a shell's `&`, as some CI
        # runners do) ignores SIGINT, and its children would inherit that and never stop.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        frames = [json.loads(proc.stdout.readline()) for _ in range(2)]  # one list a line
        assert all({r["model"] for r in frame} >= {"chat", "od", "ext"} for frame in frames)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)  # drained: a frame blocked on a full pipe must end too
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``modelyard ps ARGS`` in this process: exit status 1, nothing on stdout, one line on
    stderr (returned)."""
    assert main(["ps", *args]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


def test_gateway_down_is_one_line(capsys, monkeypatch):
    port = free_port()
    monkeypatch.setenv("MODELYARD_URL", f"http://127.0.0.1:{port}/v1")  # an SDK base URL works
    assert one_line_error(capsys) == (
        f"modelyard ps: cannot reach the gateway at http://127.0.0.1:{port}: connection refused "
        "(is `modelyard serve` running there?)"
    )


def test_gateway_that_does_not_answer_is_one_line(capsys):
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        error = one_line_error(capsys, "--url", url, "--timeout", "0.3")
    assert time.monotonic() - started < 5
    assert (
        error == f"modelyard ps: cannot reach the gateway at {url}: no answer in time (--timeout)"
    )


def test_a_server_that_does_not_speak_http_is_one_line(capsys):
    with socket.socket() as ssh:
        ssh.bind(("127.0.0.1", 0))
        ssh.listen()

        def greet() -> None:
            client, _ = ssh.accept()
            with client:
                client.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        threading.Thread(target=greet, daemon=True).start()
        url = f"http://127.0.0.1:{ssh.getsockname()[1]}"
        error = one_line_error(capsys, "--url", url, "--timeout", "5")
    assert error == (
        f"modelyard ps: unexpected answer from {url}/admin/models: not HTTP "
        "(BadStatusLine('SSH-2.0-OpenSSH_9.6\\r\\n'))"
    )


def test_wrong_or_missing_key_is_one_line(fleet: Fleet, capsys, monkeypatch):
    monkeypatch.setenv("MODELYARD_ADMIN_KEY", "sk-wrong")
    error = one_line_error(capsys, "--url", fleet.url)
    assert error == (
        "modelyard ps: the gateway refused the admin key in $MODELYARD_ADMIN_KEY "
        "(401 invalid_api_key: Incorrect admin key provided.)"
    )
    monkeypatch.delenv("MODELYARD_ADMIN_KEY")
    assert one_line_error(capsys, "--url", fleet.url) == (
        "modelyard ps: the gateway wants its admin key (401 missing_api_key: Missing API key: "
        "send it as 'Authorization: Bearer <key>'.); set $MODELYARD_ADMIN_KEY (or "
        "--admin-key-env NAME)"
    )
    monkeypatch.setenv(KEY_ENV, ADMIN)  # the variable the gateway's admin_key_env names
    assert main(["ps", "--url", fleet.url, "--admin-key-env", KEY_ENV]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("chat ")


def test_not_a_gateway_is_one_line(fleet: Fleet, capsys):
    upstream = fleet.upstream.url  # an OpenAI-compatible server without the admin API
    assert one_line_error(capsys, "--url", upstream) == (
        f"modelyard ps: {upstream}/admin/models answered 404: is a Modelyard gateway listening "
        "there?"
    )


@pytest.mark.parametrize(
    ("listing", "problem"),
    [
        ([], "models: list indices must be integers or slices, not str"),
        ({"models": {}}, "models: not a list"),
        ({"models": [{"name": "m"}]}, "models: no 'local'"),
        ({"models": [{"name": 3, "local": False}]}, "models: 3: not a string"),
    ],
)
def test_an_answer_of_another_shape_is_one_line(listing, problem, capsys, monkeypatch):
    monkeypatch.setattr("gateway.ps.command.fetch_models", lambda *_: listing)
    assert one_line_error(capsys) == f"modelyard ps: unexpected answer from the gateway: {problem}"


def test_durations_read_at_a_glance():
    cells = [duration(s) for s in (None, 0.4, 59, 60, 192, 3599, 3600, 3720, 86399, 183600)]
    assert cells == ["-", "0s", "59s", "1m00s", "3m12s", "59m59s", "1h00m", "1h02m", "23h59m",
                     "2d03h"]  # fmt: skip


def test_sizes_read_at_a_glance():
    sizes = [0, 512, 1536, 10 * 1024, 310 * MiB, int(1.24 * 2**30), 300 * 2**30]
    assert [format_size(s) for s in sizes] == [
        "0 B", "512 B", "1.5 KiB", "10 KiB", "310 MiB", "1.2 GiB", "300 GiB",
    ]  # fmt: skip


def test_a_model_row_sums_its_replicas_restarts_and_shows_the_longest_uptime():
    def replica(index: int, restarts: int, uptime_s: float | None) -> dict[str, Any]:
        pid = 100 + index if uptime_s is not None else None
        return {"index": index, "state": "ready" if pid else "backoff", "pid": pid,
                "uptime_s": uptime_s, "restarts": restarts, "measured_bytes": None,
                "in_flight": 0}  # fmt: skip

    model = {
        "name": "m", "aliases": [], "local": True, "state": "ready", "residency": "pinned",
        "in_flight": 2, "queued_requests": 0, "resident_bytes": 0, "completion_tokens_per_s": 0.0,
        "idle_s": 5.0, "ttl_left_s": None, "footprint": {"source": "estimated"},
        "replicas": [replica(0, 2, 30.0), replica(1, 1, 95.5), replica(2, 4, None)],
    }  # fmt: skip
    model_row, *replica_rows = ps_rows({"models": [model]})
    assert (model_row["restarts"], model_row["uptime_s"]) == (7, 95.5)
    assert (model_row["running"], model_row["idle_s"]) == (2, None)  # busy: not idle
    assert [r["uptime_s"] for r in replica_rows] == [30.0, 95.5, None]
