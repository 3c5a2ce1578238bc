"""Sends fuzz cases (scripts/fuzzer/cases.py) to one server and judges each answer
(scripts/fuzzer/verdicts.py says what counts as a finding); used by tests/test_fuzz.py and
scripts/fuzz.py.

Unfinished cases wait in the background (at most MAX_BACKGROUND at once) while the others run
one after another. After each finding the runner sends a valid request (``valid_probe``); if
that fails the server is restarted when it can be (a process), or the run stops (in-process). RSS
is read from /proc/PID (VmRSS, VmHWM) before and after the run, and a watchdog kills a process
server past its cap.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.processes import peak_rss_bytes, rss_bytes
from scripts.fuzzer.cases import make_case, valid_probe
from scripts.fuzzer.exchange import Answer, exchange
from scripts.fuzzer.profile import Profile
from scripts.fuzzer.report import Finding, Report
from scripts.fuzzer.request import Case
from scripts.fuzzer.servers import MIB, Server
from scripts.fuzzer.verdicts import FINDINGS, judge

MAX_BACKGROUND = 64  # unfinished requests left waiting at once


@dataclass
class Settings:
    timeout_s: float = 10.0  # a complete request's answer must come within this
    incomplete_wait_s: float = 1.0  # how long an unfinished request is left waiting
    max_wall_s: float = 600.0  # the run stops generating cases after this
    # A server process whose RSS passes its warm-up RSS by this much is killed (and restarted):
    # a runaway allocation must not take the machine down with it. None: no watchdog.
    rss_headroom: int | None = None
    warmup: int = 20  # valid requests before RSS "before" is read


class Runner:
    def __init__(self, server: Server, profile: Profile, settings: Settings) -> None:
        self.server = server
        self.profile = profile
        self.settings = settings
        self.probe_case = valid_probe(profile)
        # RSS kills by the index of the last case sent in the foreground when they happened
        # (its valid request after included): runaway allocations come from such a case.
        self._kills: dict[int, int] = {}
        self._last_index = -1
        self._rss_cap: int | None = None

    async def run(self, seed: int, count: int, only: Sequence[int] | None = None) -> Report:
        """Cases 0..count-1 of ``seed``, or just the indices in ``only`` (to reproduce some)."""
        indices = only if only is not None else range(count)
        report = Report(self.server.name, seed, len(indices))
        started = time.monotonic()
        await self._warm_up()
        self._baseline(report)
        watchdog = asyncio.create_task(self._watch_rss())
        try:
            await self._cases(report, seed, indices, started)
        finally:
            watchdog.cancel()
        self._unclaimed_kills(report, seed)
        self.server.settle()
        report.rss_after = rss_bytes(self.server.pid) or 0
        report.rss_peak = max(report.rss_peak, peak_rss_bytes(self.server.pid) or 0)
        report.wall_s = time.monotonic() - started
        return report

    async def _warm_up(self) -> None:
        for _ in range(self.settings.warmup):
            problem = await self.probe()
            if problem != "ok":
                logged = "; ".join(self.server.new_errors()) or "nothing logged"
                raise RuntimeError(
                    f"{self.server.name} does not serve a valid request: {problem} ({logged})"
                )

    async def _cases(
        self, report: Report, seed: int, indices: Iterable[int], started: float
    ) -> None:
        pending: collections.deque[tuple[Case, asyncio.Task[Answer]]] = collections.deque()
        s = self.settings
        for index in indices:
            if time.monotonic() - started > s.max_wall_s:
                report.stopped_early = f"time limit {s.max_wall_s:g} s reached at case {index}"
                break
            case = make_case(self.profile, seed, index)
            report.run += 1
            if case.incomplete:
                task = asyncio.create_task(self._send(case, s.incomplete_wait_s))
                pending.append((case, task))
            else:
                self._last_index = index
                if not await self._record(report, case, await self._send(case, s.timeout_s)):
                    break
            while pending and (pending[0][1].done() or len(pending) > MAX_BACKGROUND):
                done_case, task = pending.popleft()
                if not await self._record(report, done_case, await task):
                    return
        for done_case, task in pending:
            await self._record(report, done_case, await task)

    def _unclaimed_kills(self, report: Report, seed: int) -> None:
        """RSS kills after their case had been judged (its answer was fine, the memory not)."""
        for index, rss in self._kills.items():
            case = make_case(self.profile, seed, index)
            report.verdicts["RSS over cap"] += 1
            detail = f"killed at {rss / MIB:.0f} MiB after its answer"
            report.findings.append(
                Finding(
                    seed, index, case.label, "RSS over cap", None, detail, case.excerpt(), [], ""
                )
            )
        self._kills.clear()

    async def _send(self, case: Case, timeout_s: float) -> Answer:
        return await exchange(self.server.host, self.server.port, case, timeout_s)

    async def _record(self, report: Report, case: Case, answer: Answer) -> bool:
        """Judges one answer; False when the run must stop (a broken server it cannot restart)."""
        verdict, detail = judge(case, answer)
        verdict, detail = self._claim_kill(case, verdict, detail)
        report.statuses[
            str(answer.status) if answer.status else f"no answer ({answer.outcome})"
        ] += 1
        report.rss_peak = max(report.rss_peak, rss_bytes(self.server.pid) or 0)
        errors = self.server.new_errors()
        if verdict not in FINDINGS:
            report.verdicts[verdict] += 1
            report.logged_without_finding += [f"#{case.index} {case.label}: {e}" for e in errors]
            return True
        probe = await self._probe_or_restart(report)
        verdict, detail = self._claim_kill(case, verdict, detail)
        report.verdicts[verdict] += 1
        finding = Finding(
            case.seed, case.index, case.label, verdict, answer.status, detail, case.excerpt(),
            errors + self.server.new_errors(), probe,
        )  # fmt: skip
        report.findings.append(finding)
        if probe.startswith("failed") and "restarted" not in probe:
            report.stopped_early = f"{self.server.name} broken after case {case.index}: {probe}"
            return False
        return True

    def _claim_kill(self, case: Case, verdict: str, detail: str) -> tuple[str, str]:
        """The verdict once an RSS kill during this case (or its valid request after) counts."""
        rss = None if case.incomplete else self._kills.pop(case.index, None)
        if rss is None:
            return verdict, detail
        return "RSS over cap", f"killed at {rss / MIB:.0f} MiB (answer: {verdict} {detail})"

    async def probe(self) -> str:
        answer = await self._send(self.probe_case, self.settings.timeout_s)
        if answer.outcome == "answered" and answer.status == 200:
            return "ok"
        return f"failed ({answer.outcome} {answer.status}: {answer.detail or answer.body[:100]!r})"

    async def _probe_or_restart(self, report: Report) -> str:
        probe = await self.probe()
        if probe != "ok":
            await asyncio.sleep(0.5)  # a server may refuse for a moment (an evicted connection)
            probe = await self.probe()
        if probe == "ok" or not await self.server.restart():
            return probe
        report.restarts += 1
        self._baseline(report)  # growth is per process
        return f"{probe}; restarted"

    def _baseline(self, report: Report) -> None:
        self.server.settle()
        report.rss_before = rss_bytes(self.server.pid) or 0
        headroom = self.settings.rss_headroom
        report.rss_cap = report.rss_before + headroom if headroom is not None else None
        self._rss_cap = report.rss_cap

    async def _watch_rss(self) -> None:
        if self.settings.rss_headroom is None or self.server.pid == os.getpid():
            return
        while True:
            await asyncio.sleep(0.05)
            rss = rss_bytes(self.server.pid) or 0
            if self._rss_cap is not None and rss > self._rss_cap and self.server.alive():
                self._kills[self._last_index] = rss
                self.server.kill()
