"""Sends structured fuzz cases (structured_cases.py) to one server, one after another, while a
victim (victim.py) sends plain requests beside them; judges each answer (used by
tests/test_fuzz.py and scripts/fuzz.py --structured).

Findings (``FINDINGS``): ``crash`` (the engine process gone or replaced during the case, seen by
its PID), every finding of scripts/fuzzer/verdicts.py (5xx, hang past the per-case timeout, close
without an answer, malformed answer...), and ``broken output``: a 200 whose output breaks its
constraint (output_check.py). After a finding a plain and a tiny-schema request must succeed,
else the server is restarted (at most ``max_restarts`` times): a crashed or wedged engine would
turn every later case into a finding of the one before.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from scripts.fuzzer.draw import TOP_RUNG
from scripts.fuzzer.exchange import Answer, exchange
from scripts.fuzzer.output_check import check, outputs
from scripts.fuzzer.request import Case
from scripts.fuzzer.structured_cases import (
    StructuredCase,
    make_structured_case,
    plain_request,
    tiny_schema_request,
)
from scripts.fuzzer.structured_report import Finding, StructuredReport
from scripts.fuzzer.verdicts import FINDINGS as HTTP_FINDINGS
from scripts.fuzzer.verdicts import judge
from scripts.fuzzer.victim import Victim

FINDINGS = HTTP_FINDINGS | {"crash", "broken output"}
DEATH_WAIT_S = 1.0  # after a close without an answer: time for a dying process to be reaped


class Target(Protocol):
    """A server under fuzz: where it listens and the PID of the engine that must stay alive."""

    name: str
    host: str
    port: int
    pid: int

    def alive(self) -> bool: ...
    def new_errors(self) -> list[str]: ...
    async def restart(self) -> bool: ...


@dataclass
class StructuredSettings:
    timeout_s: float = 20.0  # per case: no answer by then is a hang
    max_wall_s: float = 1800.0  # no case starts after this
    max_rung: int = TOP_RUNG
    max_restarts: int = 20
    victim_p99_ms: float = 1000.0
    progress_every: int = 0  # a line to stderr every this many cases (0: none)


class StructuredRunner:
    def __init__(self, server: Target, model: str, settings: StructuredSettings) -> None:
        self.server, self.model, self.settings = server, model, settings
        self._probes = 0

    async def run(
        self, seed: int, count: int, only: Sequence[int] | None = None
    ) -> StructuredReport:
        """Cases 0..count-1 of ``seed``, or just the indices in ``only``."""
        indices = only if only is not None else range(count)
        s = self.settings
        report = StructuredReport(self.server.name, seed, len(indices), s.victim_p99_ms, s.max_rung)
        problem = await self.probe()
        if problem != "ok":
            raise RuntimeError(f"{self.server.name} does not serve: {problem}")
        victim = Victim(self.server, plain_request(self.model))
        victim.start()
        started = time.monotonic()
        try:
            for index in indices:
                if time.monotonic() - started > s.max_wall_s:
                    report.stopped_early = f"time limit {s.max_wall_s:g} s reached at case {index}"
                    break
                case = make_structured_case(seed, index, self.model, s.max_rung)
                if not await self._one(report, case):
                    break
                if s.progress_every and report.run % s.progress_every == 0:
                    elapsed = f"{time.monotonic() - started:.0f} s"
                    line = f"  {report.run} cases in {elapsed}: {dict(report.verdicts)}"
                    print(line, file=sys.stderr, flush=True)
        finally:
            victim.stop()
        report.victim, report.rss_mib = victim.stats(), victim.rss_mib()
        report.wall_s = time.monotonic() - started
        return report

    async def _send(self, case: Case) -> Answer:
        return await exchange(self.server.host, self.server.port, case, self.settings.timeout_s)

    async def _one(self, report: StructuredReport, case: StructuredCase) -> bool:
        """Sends and judges one case; False when the run must stop."""
        pid = self.server.pid
        t0 = time.monotonic()
        answer = await self._send(case.http)
        verdict, detail = await self._judge(case, answer, pid)
        report.record(case, answer, verdict, time.monotonic() - t0)
        if verdict not in FINDINGS:
            return True
        errors = self.server.new_errors()
        probe = "engine gone" if verdict == "crash" else await self.probe()
        if probe != "ok":
            if report.restarts >= self.settings.max_restarts:
                report.stopped_early = f"{report.restarts} restarts, at case {case.index}"
            elif await self.server.restart():
                report.restarts += 1
                probe += "; restarted"
            else:
                report.stopped_early = f"{self.server.name} not restarted after case {case.index}"
        report.findings.append(
            Finding(
                case.seed,
                case.index,
                case.generator,
                case.label,
                verdict,
                answer.status,
                detail,
                errors + self.server.new_errors(),
                probe,
            )
        )
        return report.stopped_early is None

    async def _judge(self, case: StructuredCase, answer: Answer, pid: int) -> tuple[str, str]:
        if answer.outcome != "answered":
            deadline = time.monotonic() + DEATH_WAIT_S
            while self.server.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if not self.server.alive() or self.server.pid != pid:
            return "crash", f"engine PID {pid} gone; answer: {answer.outcome} {answer.status}"
        verdict, detail = judge(case.http, answer)
        if verdict in FINDINGS:
            return verdict, detail
        if answer.status != 200:
            return f"refused ({answer.status})", ""
        found = outputs(answer.body)
        if not found:
            return "broken output", f"a 200 without choices: {answer.body[:120]!r}"
        checked = [check(case.constraint, out) for out in found]
        worst = next((c for c in checked if c[0] == "broken"), checked[0])
        return ("broken output" if worst[0] == "broken" else f"200 {worst[0]}"), worst[1]

    async def probe(self) -> str:
        """A plain and a tiny-schema request (a new one each time): "ok" when both answer 200."""
        self._probes += 1
        for case in (
            plain_request(self.model, 1),
            tiny_schema_request(self.model, f"probe {self._probes}"),
        ):
            answer = await self._send(case)
            if answer.status != 200:
                return f"{case.label} failed ({answer.outcome} {answer.status})"
        return "ok"
