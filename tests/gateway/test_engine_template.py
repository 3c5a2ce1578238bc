"""Engines forked from an engine template (gateway/engines/template.py, engine/template/): the wire
and the fallbacks with a template that imports nothing (this module run as ``python -m``), then
real engines over a tiny local Llama: a forked engine starts without its imports and answers, a
kill during its start is a kill, a dead template leaves the pool exec'ing engines, a SIGKILLed
gateway takes template and engines with it; and the parts: the command line, PSS (the setting:
tests/gateway/config/test_clients.py).

No timings are asserted beyond the engine's own "imports and http server" phase; the start-up
and memory figures are measured outside the tests."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from common import processes
from common.engine_args import SPIN_WAIT_FLAG
from common.net import free_port
from common.template_wire import (
    CMDLINE_ROOM_FLAG,
    PREPARE,
    SOCKET_FD_FLAG,
    WireError,
    decode,
    encode,
)
from engine.template.cmdline import fit
from gateway.config.schema import EngineLogSettings
from gateway.engines import template as template_module
from gateway.engines.logs import EngineLog, EngineLogs
from gateway.engines.process import exit_reason, has_exited, relay_output
from gateway.engines.replica import ReplicaState
from gateway.engines.template import (
    TEMPLATE_TRANSITIONS,
    EngineTemplate,
    EngineTemplates,
    ForkedEngine,
    TemplateState,
)
from gateway.residency.footprint import measured_bytes
from tests.gateway import test_kill_recovery as kill_recovery
from tests.gateway.conftest import REPO_ROOT
from tests.gateway.serve_process import ServeProcess, http_get
from tests.gateway.test_kill_recovery import complete, real_model, starting, transitions
from tests.gateway.test_resilience import wait_for

S = ReplicaState
LIGHT_TEMPLATE = "tests.gateway.test_engine_template"  # this module, as a template (see the end)
engines, spawns = kill_recovery.engines, kill_recovery.spawns  # fixtures: real engines, their pids
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's"
)


# ---- the parts ----


def test_the_footprint_plans_with_pss_where_the_engine_reports_it():
    memory = {"rss_bytes": 600, "pss_bytes": 150, "activation_bytes": 10}
    assert measured_bytes({"memory": memory}, awake=False) == 150
    assert measured_bytes({"memory": memory}, awake=True) == 160
    assert measured_bytes({"memory": {"rss_bytes": 600}}, awake=False) == 600  # an older engine


def test_wire_messages_and_the_engine_command_line_in_the_templates_room():
    assert decode(encode("fork", id=1, argv=["--model", "m"])) == {
        "kind": "fork", "id": 1, "argv": ["--model", "m"]
    }  # fmt: skip
    for bad in (b"[]", b"{}", b"not json", b'{"kind": 1}'):
        with pytest.raises(WireError):
            decode(bad)
    with pytest.raises(WireError):
        encode("fork", argv=["x" * (1 << 16)])
    assert fit(["python", "-m", "engine"], 20) == b"python\0-m\0engine\0".ljust(20, b"\0")
    # whole arguments only, and a NUL at the end (the kernel shows the area as it is)
    assert fit(["python", "-m", "engine", "--model"], 17) == b"python\0-m\0engine\0"
    assert fit(["python", "-m", "engine", "--model"], 16) == b"python\0-m\0".ljust(16, b"\0")


@linux_only
def test_the_thread_check_sees_a_thread_that_python_does_not_know_of_too():
    code = (
        "import threading, time\n"
        "from engine.template.preload import thread_problem\n"
        "print(thread_problem())\n"
        "threading.Thread(target=time.sleep, args=(1,), daemon=True).start()\n"
        "print(thread_problem())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()  # fmt: skip
    assert out[0] == "None" and out[1].startswith("2 threads run")


# ---- the wire, with a template that imports nothing ----


@pytest.fixture
async def light_templates(tmp_path):
    """EngineTemplates whose template is this module (no imports: it forks in milliseconds)."""
    made: list[EngineTemplates] = []
    logs = EngineLogs(EngineLogSettings(), tmp_path / "logs")

    def make(module: str = LIGHT_TEMPLATE) -> EngineTemplates:
        templates = EngineTemplates(str(REPO_ROOT), logs, module=module)
        templates.configure(True, {False})
        made.append(templates)
        return templates

    yield make
    for templates in made:
        await templates.stop()


async def fork(templates: EngineTemplates, *argv: str) -> tuple[ForkedEngine, EngineLog]:
    engine = await templates.fork(list(argv), str(REPO_ROOT), spin_wait=False)
    assert isinstance(engine, ForkedEngine)
    output = templates.logs.replica("m", engine.pid)
    engine.relay = asyncio.create_task(relay_output(engine, output))  # type: ignore[attr-defined]
    return engine, output


@linux_only
async def test_a_forked_engine_gets_its_output_pipe_session_and_exit_status(light_templates):
    templates = light_templates()
    engine, output = await fork(templates, "--model", "/nowhere/model.gguf")
    assert await asyncio.wait_for(engine.wait(), 30) == 2  # the engine's CLI refused the flag
    await engine.relay  # type: ignore[attr-defined]
    assert any("--model /nowhere/model.gguf: no such file or directory" in line
               for line in output.tail(50))  # fmt: skip
    assert engine.returncode == 2 and has_exited(engine)
    (template,) = templates.describe()
    assert template["state"] == "ready" and template["engines"] == 0


@linux_only
async def test_a_ready_template_is_asked_to_prepare_for_its_policys_on_demand_engines(
    light_templates, monkeypatch
):
    """Each engine once, though the config is applied again."""
    sent: list[tuple[bytes, list[int]]] = []
    send = template_module.send

    def record(sock: socket.socket, data: bytes, fds: list[int]) -> None:
        if decode(data)["kind"] == PREPARE:
            sent.append((data, fds))
        send(sock, data, fds)

    monkeypatch.setattr(template_module, "send", record)
    templates = light_templates()
    ahead = {False: [["--model", "a.gguf"], ["--model", "b.gguf"]], True: [["--model", "c.gguf"]]}
    templates.configure(True, {False}, ahead)
    templates.configure(True, {False}, ahead)
    await wait_for(lambda: len(sent) >= 2, 60)
    await asyncio.sleep(0.3)  # nothing more comes
    asked = [decode(data) for data, _ in sent]
    assert [(m["argv"], m["cwd"]) for m in asked] == [(a, str(REPO_ROOT)) for a in ahead[False]]


def test_a_template_builds_what_it_is_asked_to_prepare_for_only_once_idle(capsys):
    """A prepare message is queued, not handled on receipt: the template's loop builds it
    (`_prepare_one`) only when its poll finds no message waiting; a malformed one is dropped."""
    from engine.template.preload import Preloaded
    from engine.template.server import TemplateServer

    class Shelf:
        def __init__(self) -> None:
            self.calls: list[tuple[list[str], str | None]] = []

        def prepare_ahead(self, argv: list[str], cwd: str | None) -> str:
            self.calls.append((argv, cwd))
            return "built"

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    shelf = Shelf()
    server = TemplateServer(theirs.detach(), Preloaded(), tokenizers=shelf)  # type: ignore[arg-type]
    try:
        ours.send(encode(PREPARE, argv=["--model", "m.gguf"], cwd="/models"))
        ours.send(encode(PREPARE, argv="--model m.gguf", cwd=None))
        assert server._serve_one() and server._serve_one()
        assert list(server.ahead) == [(["--model", "m.gguf"], "/models")] and shelf.calls == []
        server._prepare_one()
        assert shelf.calls == [(["--model", "m.gguf"], "/models")] and not server.ahead
        said = capsys.readouterr().err
        assert "dropped a prepare message" in said and "built" in said
    finally:
        ours.close()
        server.sock.close()


@linux_only
async def test_a_forked_engine_killed_is_reported_killed_by_its_signal(light_templates, tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    templates = light_templates()
    # valid flags: it goes on to import torch (not preloaded here), which takes a while
    engine, _ = await fork(templates, "--model", str(source), "--port", str(free_port()))
    # its own command line, once it has written it over the template's (after its setsid)
    await wait_for(lambda: processes.cmdline(engine.pid)[1:3] == ["-m", "engine"], timeout=10)
    assert processes.cmdline(engine.pid)[3:5] == ["--model", str(source)]
    stat = Path(f"/proc/{engine.pid}/stat").read_text().rsplit(")", 1)[1].split()
    template_pid = templates.describe()[0]["pid"]
    assert int(stat[1]) == template_pid  # its parent: the template, which reaps it
    assert os.getsid(engine.pid) == engine.pid != os.getsid(template_pid)  # its own session
    os.kill(engine.pid, signal.SIGKILL)
    code = await asyncio.wait_for(engine.wait(), 30)
    assert exit_reason(code) == "killed by SIGKILL"


@linux_only
async def test_a_dead_template_takes_its_engines_and_forks_fall_back_until_a_restart(
    light_templates, tmp_path, monkeypatch, caplog
):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    templates = light_templates()
    engine, _ = await fork(templates, "--model", str(source), "--port", str(free_port()))
    template_pid = templates.describe()[0]["pid"]
    with caplog.at_level(logging.WARNING, "modelyard.pool"):
        os.kill(template_pid, signal.SIGKILL)
        assert exit_reason(await asyncio.wait_for(engine.wait(), 10)) == "killed by SIGKILL"
        assert not processes.alive(engine.pid)
        await wait_for(lambda: templates.describe()[0]["state"] == "gone", timeout=10)
    assert "engine template (passive) gone" in caplog.text
    # within RESTART_AFTER_S: exec'd (None), no new template
    assert await templates.fork(["--model", str(source)], None, spin_wait=False) is None
    assert templates.describe()[0]["state"] == "gone"
    monkeypatch.setattr(template_module, "RESTART_AFTER_S", 0.0)
    again, _ = await fork(templates, "--model", "/nowhere")
    assert await asyncio.wait_for(again.wait(), 30) == 2
    assert templates.describe()[0]["pid"] not in (None, template_pid)


@linux_only
async def test_a_template_that_does_not_start_means_exec(light_templates, caplog):
    templates = light_templates("tests.gateway.no_such_template_module")
    with caplog.at_level(logging.WARNING, "modelyard.pool"):
        assert await templates.fork(["--model", "m"], None, spin_wait=False) is None
    assert "not ready (gone): starting the engine without it" in caplog.text


@linux_only
async def test_templates_follow_the_wait_policies_in_use_and_the_switch(light_templates):
    templates = light_templates()
    templates.configure(True, {False, True})
    await wait_for(lambda: len(templates.describe()) == 2, timeout=5)
    spinning = templates._templates[True]
    assert await spinning.wait_ready(30)
    templates.configure(True, {False})  # the fleet grew: nobody spins any more
    await wait_for(lambda: spinning.state is TemplateState.GONE, timeout=10)
    assert [t["wait_policy"] for t in templates.describe()] == ["passive"]
    templates.configure(False, {False})
    await wait_for(lambda: templates.describe() == [], timeout=10)
    assert await templates.fork(["--model", "m"], None, spin_wait=False) is None


# ---- real engines ----


@linux_only
async def test_a_forked_engine_killed_while_starting_restarts_forked_and_answers_without_imports(
    engines, smollm2_gguf, spawns
):
    from engine.model.loader import converted_gguf_dir  # not at the top: see the module's end

    converted_gguf_dir(smollm2_gguf)  # seen before: the template builds its tokenizer
    gateway, url = await engines({"gateway": {"watch_config": False},
                                  "models": [real_model("od", smollm2_gguf)]})  # fmt: skip
    seen = transitions(gateway)
    client = gateway.pool.client
    ready = client.ready

    async def not_the_first_engine(engine_url: str) -> bool:
        return len(spawns) > 1 and await ready(engine_url)

    client.ready = not_the_first_engine  # type: ignore[method-assign]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        held = asyncio.create_task(complete(session, url, "od"))
        replica = await starting(gateway, "od", spawns, 1)
        first = replica.proc
        assert isinstance(first, ForkedEngine)
        await wait_for(lambda: any("loading model" in line for line in replica.log.tail(50)), 60)
        os.kill(first.pid, signal.SIGKILL)
        status, text = await asyncio.wait_for(held, 180)
        client.ready = ready  # type: ignore[method-assign]
        assert status == 200, text
        assert exit_reason(first.returncode) == "killed by SIGKILL"
        assert (S.STARTING, S.BACKOFF) in seen and replica.restarts == 1
        engine = replica.proc
        assert isinstance(engine, ForkedEngine) and engine.pid == spawns[1]
        async with session.get(replica.url + "/status") as resp:
            engine_status = await resp.json()
    # Started at the fork: its imports were the template's, and so was its tokenizer, built
    # once for both engines.
    assert engine_status["startup_s"]["imports and http server"] < 1.0
    assert any("the one the engine template built" in line for line in replica.log.tail(200))
    template_log = gateway.pool.templates.logs.template("spin-wait").tail(200)
    assert sum("built for its engines" in line for line in template_log) == 1, template_log
    memory = engine_status["memory"]
    assert 0 < memory["pss_bytes"] < memory["rss_bytes"]  # it shares the template's pages
    (template,) = gateway.pool.templates.describe()
    assert template["state"] == "ready" and template["engines"] == 1 and template["pss_bytes"] > 0
    argv = processes.cmdline(engine.pid)
    assert "engine" in argv and argv[argv.index("--served-model-name") + 1] == "od"
    assert SPIN_WAIT_FLAG in argv  # the fleet's only engine: it came from the spinning template
    assert template["wait_policy"] == "spin-wait"


@linux_only
async def test_engines_are_execd_when_the_template_dies_and_the_model_still_loads(
    engines, tiny_llama_dir, caplog
):
    gateway, url = await engines({"gateway": {"watch_config": False},
                                  "models": [real_model("od", tiny_llama_dir)]})  # fmt: skip
    seen = transitions(gateway)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        first = await complete(session, url, "od")
        assert first[0] == 200
        (replica,) = gateway.pool.replicas["od"]
        forked = replica.proc
        assert isinstance(forked, ForkedEngine)
        (template,) = gateway.pool.templates.describe()
        with caplog.at_level(logging.WARNING, "modelyard.pool"):
            os.kill(template["pid"], signal.SIGKILL)
            await wait_for(lambda: replica.proc is not forked and replica.state is S.READY, 180)
        assert exit_reason(forked.returncode) == "killed by SIGKILL"  # died with its template
        assert isinstance(replica.proc, asyncio.subprocess.Process)  # exec'd, as before
        assert await complete(session, url, "od") == first  # greedy: the same answer
    assert (S.READY, S.BACKOFF) in seen and replica.restarts == 1
    assert "could not fork" in caplog.text or "not ready (gone)" in caplog.text


@linux_only
async def test_with_the_template_off_engines_are_execd(engines, tiny_llama_dir):
    gateway, url = await engines({"gateway": {"watch_config": False, "engine_template": False},
                                  "models": [real_model("od", tiny_llama_dir)]})  # fmt: skip
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        assert (await complete(session, url, "od"))[0] == 200
    (replica,) = gateway.pool.replicas["od"]
    assert isinstance(replica.proc, asyncio.subprocess.Process)
    assert gateway.pool.templates.describe() == []


@linux_only
def test_a_sigkilled_gateway_takes_its_template_and_forked_engines(tmp_path, tiny_llama_dir):
    model = {**real_model("m", tiny_llama_dir), "residency": "pinned"}
    del model["idle_ttl_s"]
    gateway = ServeProcess({"gateway": {"watch_config": False}, "models": [model]}, tmp_path,
                           free_port())  # fmt: skip
    try:
        gateway.wait_ready(1, timeout=180)
        _, listing = http_get(gateway.url + "/admin/models")
        engine = listing["models"][0]["replicas"][0]["pid"]
        (template,) = processes.children(gateway.proc.pid)
        assert "engine.template" in processes.cmdline(template)
        assert processes.children(template) == [engine]
        gateway.proc.send_signal(signal.SIGKILL)
        gateway.proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while any(processes.alive(p) for p in (template, engine)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not processes.alive(template) and not processes.alive(engine)
    finally:
        gateway.stop()


# ---- this module as a template without imports ----


def _light_template() -> int:
    from engine.template.preload import Preloaded
    from engine.template.server import TemplateServer

    parser = argparse.ArgumentParser()
    parser.add_argument(SOCKET_FD_FLAG, type=int, dest="socket_fd")
    parser.add_argument(SPIN_WAIT_FLAG, action="store_true")
    parser.add_argument(CMDLINE_ROOM_FLAG)
    options = parser.parse_args()
    return TemplateServer(options.socket_fd, Preloaded()).run()


if __name__ == "__main__":
    sys.exit(_light_template())


async def test_a_templates_state_changes_only_along_its_transition_table() -> None:
    """Every state has its row; a template becomes ready only while starting, and a gone one
    stays gone (a new template replaces it)."""
    assert set(TEMPLATE_TRANSITIONS) == set(TemplateState)
    output = EngineLog(Path("/nonexistent/template.log"), 2**20, 1)  # never written here
    template = EngineTemplate(spin_wait=False, cwd=None, output=output)
    assert template.state is TemplateState.STARTING
    template._set_state(TemplateState.READY)
    with pytest.raises(RuntimeError, match="ready -> starting"):
        template._set_state(TemplateState.STARTING)
    template._set_state(TemplateState.STOPPING)
    template._handle({"kind": "ready", "pid": 1})  # its imports done as it is stopped: ignored
    assert template.state is TemplateState.STOPPING
    template._gone("test")
    assert template.state is TemplateState.GONE
    with pytest.raises(RuntimeError):
        template._set_state(TemplateState.READY)
