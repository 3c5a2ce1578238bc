"""A bounded, seeded HTTP fuzz of both servers (the package scripts/fuzzer/: cases from cases.py,
sent by runner.py and judged by verdicts.py, whose docstring says what counts as a finding). The
longer run is scripts/fuzz.py.

- gateway: in process (its runner and app, as ``modelyard serve`` builds them), API keys on,
  routing m1 to a mock upstream and ``down`` to a closed port;
- engine: a real ``python -m engine`` process on the tiny random Llama (a real EngineCore; a
  process, so that its RSS is its own and a runaway allocation can be killed by PID).

Each must give 0 5xx (502-504 only for ``down``), 0 non-JSON error bodies, 0 hangs, 0 closes
without an answer (except where scripts/fuzzer/verdicts.py allows them) and bounded RSS growth. A
failure lists the findings grouped by cause, each with the seed and index that rebuild its case:
``make_case(gateway_profile(...) or engine_profile(), seed, index)``.

The structured fuzz (scripts/fuzzer/structured_runner.py): its cases' reproducibility, the output
validator on known outputs, and a short run of constraints up to the sizes issue 29 found
crashing or stalling the engine, against the tiny model.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from common.net import free_port
from engine.model.host_memory import trim_heap
from gateway.app import Gateway, create_app
from gateway.config import load_config
from gateway.server import GatewayRunner
from scripts.fuzzer.constraints import Constraint, anyof_objects, counted_regex, ref_chain_tools
from scripts.fuzzer.logs import LogCapture
from scripts.fuzzer.output_check import Output, check
from scripts.fuzzer.profile import engine_profile, gateway_profile
from scripts.fuzzer.report import Report
from scripts.fuzzer.runner import Runner, Settings
from scripts.fuzzer.servers import (
    GATEWAY_ADMIN_ENV,
    GATEWAY_KEY_ENV,
    GATEWAY_KEYS,
    MIB,
    ProcessServer,
    engine_command,
    gateway_document,
)
from scripts.fuzzer.structured_cases import GENERATORS, make_structured_case
from scripts.fuzzer.structured_runner import StructuredRunner, StructuredSettings
from tests.gateway.conftest import MockUpstream

pytestmark = pytest.mark.timeout(300)

SEED = 20260601
GATEWAY_CASES = 2500
ENGINE_CASES = 2500
# RSS growth from after the warm-up to the end of the run. Bodies reach 4 MiB and inflated ones
# stop at the 4 MiB limit, so the allocator may keep a few such buffers (tens of MiB) after the
# peak; retaining anything per request (a body, a parsed payload: >= ~1 KiB each) over thousands
# of cases, or inflating a bomb past the limit once (32 MiB), goes beyond these bounds.
GATEWAY_RSS_GROWTH = 64 * MIB  # the test process itself: the gateway and this client
ENGINE_RSS_GROWTH = 96 * MIB  # the engine adds tokenizer and KV bookkeeping per request
ENGINE_FLAGS = (
    "--kv-cache-memory", "16MiB", "--max-num-seqs", "16", "--max-model-len", "256",
    "--num-threads", "1", "--max-queue", "64",
)  # fmt: skip


class InProcessGateway:
    """The gateway served from this process; the runner's Server. It cannot be restarted: a
    run that breaks it stops there, and the report says so."""

    name = "gateway"
    host = "127.0.0.1"

    def __init__(self, port: int, capture: LogCapture) -> None:
        self.port = port
        self.pid = os.getpid()
        self._capture = capture

    def new_errors(self) -> list[str]:
        return self._capture.new_errors()

    def alive(self) -> bool:
        return True

    def settle(self) -> None:
        """Growth is measured on what this shared test process retains, not on the free heap
        that earlier tests' models left in glibc's arenas."""
        gc.collect()
        trim_heap()

    def kill(self) -> None:
        """Never: this process is the test."""

    async def restart(self) -> bool:
        return False


def assert_clean(report: Report, rss_growth_bound: int) -> None:
    print(report.summary())
    problems = []
    if report.findings:
        problems.append(f"{len(report.findings)} findings")
    if report.rss_growth > rss_growth_bound:
        problems.append(
            f"RSS grew {report.rss_growth / MIB:.1f} MiB, over {rss_growth_bound / MIB:.0f} MiB"
        )
    if report.stopped_early:
        problems.append(report.stopped_early)
    assert not problems, "; ".join(problems) + "\n" + report.summary(examples=40)


async def test_gateway_survives_fuzzing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in GATEWAY_KEYS.items():
        monkeypatch.setenv(name, value)
    mock = MockUpstream("fuzz-mock").start()
    capture = LogCapture()
    logging.getLogger().addHandler(capture)
    runner: web.AppRunner | None = None
    try:
        mock.control(tokens=2)  # whatever max_tokens a fuzzed body asks for
        path = tmp_path / "models.yaml"
        dead = f"http://127.0.0.1:{free_port()}"
        path.write_text(yaml.safe_dump(gateway_document(mock.url, dead)))
        runner = GatewayRunner(
            create_app(Gateway(load_config(path), str(path))), handler_cancellation=True
        )
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        profile = gateway_profile(GATEWAY_KEYS[GATEWAY_KEY_ENV], GATEWAY_KEYS[GATEWAY_ADMIN_ENV])
        settings = Settings(timeout_s=5.0, incomplete_wait_s=2.5, max_wall_s=120.0)
        report = await Runner(InProcessGateway(port, capture), profile, settings).run(
            SEED, GATEWAY_CASES
        )
    finally:
        logging.getLogger().removeHandler(capture)
        if runner is not None:
            await runner.cleanup()
        mock.stop()
    assert_clean(report, GATEWAY_RSS_GROWTH)


async def test_engine_survives_fuzzing(tiny_llama_dir: Path, tmp_path: Path) -> None:
    server = ProcessServer("engine", engine_command(tiny_llama_dir, "tiny", ENGINE_FLAGS), tmp_path)
    server.start()
    try:
        # 1 GiB over the warm-up RSS: far past any bounded request, well before the machine's.
        settings = Settings(
            timeout_s=8.0, incomplete_wait_s=1.0, max_wall_s=150.0, rss_headroom=1024 * MIB
        )
        report = await Runner(server, engine_profile("tiny"), settings).run(SEED, ENGINE_CASES)
    finally:
        server.stop()
    assert_clean(report, ENGINE_RSS_GROWTH)


STRUCTURED_CASES = 300
# Up to the fourth rung: the sizes issue 29 found crashing or stalling the engine (ref chains of
# 2,000 to 2,500, Lark chains of 3,000, 300 patternProperties, 300x300 counted repetitions).
STRUCTURED_RUNG = 3


def test_structured_cases_rebuild_alone() -> None:
    """Every case is a pure function of (seed, index): a finding's numbers rebuild it; the mix
    reaches every generator, and max_rung caps the sizes."""
    small = [make_structured_case(SEED, i, "m", max_rung=0) for i in range(400)]
    assert [c.http.wire() for c in small[:50]] == [
        make_structured_case(SEED, i, "m", max_rung=0).http.wire() for i in range(50)
    ]
    assert {c.generator for c in small} == {maker.__name__ for maker, _ in GENERATORS}
    assert max(len(c.http.body) for c in small) < 20_000
    full = [make_structured_case(SEED, i, "m") for i in range(400)]
    assert max(len(c.http.body) for c in full) > 100_000  # the pathological rungs are drawn


@pytest.mark.parametrize(
    ("constraint", "output", "verdict"),
    [
        (Constraint("json_schema", {"type": "boolean"}), Output("true", None, "stop"), "valid"),
        (Constraint("json_schema", {"type": "boolean"}), Output("1", None, "stop"), "broken"),
        (Constraint("json_schema", anyof_objects(3)), Output('{"', None, "abort"), "broken"),
        (Constraint("json_schema", anyof_objects(3)), Output('{"', None, "length"), "incomplete"),
        (Constraint("regex", counted_regex(3, 3), True), Output("ab", None, "abort"), "broken"),
        (
            Constraint("regex", counted_regex(3, 3), True),
            Output("abbba", None, "length"),
            "incomplete",
        ),
        (Constraint("regex", counted_regex(3, 3), True), Output("abba", None, "length"), "broken"),
        (Constraint("regex", "[0-9]+", False), Output("x", None, "stop"), "unchecked"),
        (Constraint("choice", ["yes", "no"]), Output("yes", None, "stop"), "valid"),
        (Constraint("choice", ["yes", "no"]), Output("ye", None, "stop"), "broken"),
        (Constraint("json_object"), Output("[1]", None, "stop"), "broken"),
        (Constraint("grammar", 'start: "a"'), Output("b", None, "stop"), "unchecked"),
        (
            Constraint("tools", ref_chain_tools(2)),
            Output(None, [{"function": {"name": "f", "arguments": '{"a": 5}'}}], "tool_calls"),
            "broken",
        ),
        (
            Constraint("tools", ref_chain_tools(2)),
            Output(None, [{"function": {"name": "f", "arguments": '{"a": "x"}'}}], "tool_calls"),
            "valid",
        ),
        (Constraint("tools", ref_chain_tools(2)), Output("[]", None, "stop"), "broken"),
    ],
)
def test_output_check(constraint: Constraint, output: Output, verdict: str) -> None:
    assert check(constraint, output)[0] == verdict


async def test_engine_survives_structured_fuzzing(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Constraints of every generator, up to pathological sizes, against a real engine while a
    victim sends plain requests: no crash, no 5xx or hang, no 200 that breaks its constraint.
    (scripts/fuzz.py --structured runs thousands, the largest sizes too, on SmolLM2.)"""
    server = ProcessServer("engine", engine_command(tiny_llama_dir, "tiny", ENGINE_FLAGS), tmp_path)
    server.start()
    try:
        settings = StructuredSettings(
            timeout_s=15.0, max_wall_s=60.0, max_rung=STRUCTURED_RUNG, max_restarts=2,
            victim_p99_ms=5000.0,  # a shared 2-core machine: the tight bound is the script's
        )  # fmt: skip
        report = await StructuredRunner(server, "tiny", settings).run(SEED, STRUCTURED_CASES)
    finally:
        server.stop()
    print(report.summary())
    assert report.verdicts["200 valid"] > 0, report.summary()  # outputs were judged
    assert not report.problems(), report.summary(examples=40)
