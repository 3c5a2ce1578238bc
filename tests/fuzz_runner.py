"""Sends fuzz cases (tests/fuzzing.py) to one server over raw asyncio streams and judges each
answer; used by tests/test_fuzz.py and scripts/fuzz.py.

What counts as a finding (``FINDINGS``):

- ``5xx``: any answer >= 500; a 500 always. The only exception: 502/503/504 (JSON) from the
  gateway for a case routed to its model whose upstream is deliberately down
  (``Case.unavailable_ok``). A 5xx the gateway relays from its working upstream counts too: that
  mock answers 2 tokens to any body the gateway forwards, so it has no reason to fail.
- ``non-JSON error body``: an answer >= 400 (HEAD aside, which has no body) that is not
  ``application/json`` of exactly ``{"error": {"message", "type", "param", "code"}}``.
- ``hang``: no complete answer within the per-case timeout, for a case that sent a whole request.
- ``closed without answer``: the server closed the connection without answering. Right only for
  bytes that are not HTTP/1.x at all (``Case.may_close``: TLS, the HTTP/2 preface, binary noise,
  HTTP/0.9) and for requests left unfinished on purpose (``Case.incomplete``), whose answer may
  also never come (``pending (allowed)``) because the server is right to wait for the rest.
- ``malformed answer``: bytes that are not an HTTP/1.0 or 1.1 answer (a status line in another
  version included), or an answer cut short.
- ``error event in stream``: a 200 event stream carrying an internal (server) error event.
- ``RSS over cap``: the server process passed the RSS cap during a case; the runner kills it (only
  a process it started) and starts a fresh one.

After each finding the runner sends a valid request (``valid_probe``); if that fails the server
is restarted when it can be (a process), or the run stops (in-process). RSS is read from
/proc/PID (VmRSS, VmHWM) before and after the run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common.net import free_port
from tests.fuzzing import Case, Profile, make_case, valid_probe

ANSWER_CAP = 16 * 2**20  # an answer longer than this is cut (none should come near)
MAX_BACKGROUND = 64  # unfinished requests left waiting at once
ERROR_KEYS = {"message", "type", "param", "code"}
INTERNAL_TYPES = {"internal_error", "server_error"}
FINDINGS = {
    "5xx",
    "non-JSON error body",
    "hang",
    "closed without answer",
    "malformed answer",
    "error event in stream",
    "RSS over cap",
    "connection refused",
}
MIB = 2**20


# ---- one exchange ----------------------------------------------------------------------------


@dataclass
class Answer:
    outcome: str  # answered | timeout | closed | malformed | refused
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    detail: str = ""


async def exchange(host: str, port: int, case: Case, timeout_s: float) -> Answer:
    """Sends the case's bytes as they are while reading one answer (a server may answer before
    it has read the whole body); the connection is reset afterwards, leaving no TIME_WAIT."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=2 * MIB), timeout_s
        )
    except (OSError, TimeoutError) as exc:
        return Answer("refused", detail=repr(exc))
    sender = asyncio.create_task(_send(writer, case.wire()))
    try:
        async with asyncio.timeout(timeout_s):
            return await read_answer(reader, case.method)
    except TimeoutError:
        return Answer("timeout", detail=f"no answer within {timeout_s:g} s")
    finally:
        sender.cancel()
        _reset(writer)


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        writer.write(data)
        await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def read_answer(reader: asyncio.StreamReader, method: str) -> Answer:
    try:
        status, headers = await _read_head(reader)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return Answer("closed", detail="EOF before any answer")
        return Answer("malformed", detail=f"head cut short: {exc.partial[:120]!r}")
    except ConnectionError as exc:
        return Answer("closed", detail=repr(exc))
    except (ValueError, asyncio.LimitOverrunError) as exc:
        return Answer("malformed", detail=f"head: {exc}"[:200])
    try:
        body = await _read_body(reader, method, status, headers)
    except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
        return Answer("malformed", status, headers, detail=f"body cut short: {exc!r}"[:200])
    return Answer("answered", status, headers, body)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    while True:  # 100 Continue and other interim answers come before the real one
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        version, code, *_ = status_line.split(" ", 2)
        if version not in ("HTTP/1.0", "HTTP/1.1"):
            raise ValueError(f"not an HTTP/1.0 or 1.1 status line: {status_line[:80]!r}")
        status = int(code)
        if not 100 <= status < 200 or status == 101:
            break
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_body(
    reader: asyncio.StreamReader, method: str, status: int, headers: dict[str, str]
) -> bytes:
    if method == "HEAD" or status in (101, 204, 304):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return await _read_chunked(reader)
    if "content-length" in headers:
        return await reader.readexactly(min(int(headers["content-length"]), ANSWER_CAP))
    return await reader.read(ANSWER_CAP)  # until the server closes


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    size = 0
    while size <= ANSWER_CAP:
        line = await reader.readuntil(b"\r\n")
        length = int(line.split(b";")[0].strip(), 16)
        if length == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            break
        parts.append(await reader.readexactly(length))
        await reader.readexactly(2)
        size += length
    return b"".join(parts)


# ---- judging ---------------------------------------------------------------------------------


def judge(case: Case, answer: Answer) -> tuple[str, str]:
    """(verdict, detail): a verdict in FINDINGS is a finding."""
    if answer.outcome == "timeout":
        return ("pending (allowed)" if case.incomplete else "hang"), answer.detail
    if answer.outcome == "closed":
        allowed = case.may_close or case.incomplete
        return ("closed (allowed)" if allowed else "closed without answer"), answer.detail
    if answer.outcome == "malformed":
        return "malformed answer", answer.detail
    if answer.outcome == "refused":
        return "connection refused", answer.detail
    status = answer.status or 0
    problem = error_body_problem(answer) if status >= 400 and case.method != "HEAD" else None
    if status >= 500:
        if case.unavailable_ok and status in (502, 503, 504) and problem is None:
            return "upstream unavailable (allowed)", ""
        return "5xx", problem or _error_message(answer.body)
    if problem is not None:
        return "non-JSON error body", problem
    if status == 200 and answer.headers.get("content-type", "").startswith("text/event-stream"):
        event = _internal_error_event(answer.body)
        if event is not None:
            return "error event in stream", event
    return "ok", ""


def error_body_problem(answer: Answer) -> str | None:
    """What is wrong with an error answer's body, or None when it has the OpenAI shape."""
    content_type = answer.headers.get("content-type", "")
    if not content_type.startswith("application/json"):
        return f"Content-Type {content_type!r}, body {answer.body[:120]!r}"
    try:
        error = json.loads(answer.body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error object: {answer.body[:120]!r}"
    if not isinstance(error, dict) or set(error) != ERROR_KEYS:
        return f"error keys {sorted(error) if isinstance(error, dict) else error!r}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return f"error message/type not strings: {answer.body[:120]!r}"
    return None


def _error_message(body: bytes) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        error = json.loads(body)["error"]
        return f"{error.get('code')}: {str(error.get('message'))[:120]}"
    return repr(body[:120])


def _internal_error_event(body: bytes) -> str | None:
    for line in body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        with contextlib.suppress(ValueError):
            error = json.loads(line[6:]).get("error")
            if isinstance(error, dict) and (
                error.get("type") in INTERNAL_TYPES or error.get("code") == "internal_error"
            ):
                return str(error.get("message"))[:160]
    return None


# ---- server logs -----------------------------------------------------------------------------

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_REPO = str(Path(__file__).resolve().parents[1]) + "/"


def tracebacks_in(text: str) -> list[str]:
    """Each traceback in ``text`` as one line: the innermost frame in this repository (else the
    innermost frame) and the exception, e.g. ``engine/serving/requests.py:163 in parse_messages:
    TypeError: unhashable type: 'list'``."""
    found: list[str] = []
    frames: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            inside, frames = True, []
        elif inside and (match := _FRAME.search(line)):
            file = match["file"].removeprefix(_REPO)
            frames.append(f"{file}:{match['line']} in {match['func']}")
        elif inside and line and not line.startswith((" ", "\t")):
            ours = [f for f in frames if not f.startswith("/")]
            where = (ours or frames or ["?"])[-1]
            found.append(f"{where}: {line.strip()[:160]}")
            inside = line.startswith(("During handling", "The above exception"))
    return found


class LogFile:
    """A server's log file, read from where the last call stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_errors(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError), self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
            # Up to the last complete line: a traceback still being written is read next time.
            end = data.rfind(b"\n") + 1
            self.offset += end
            text = data[:end].decode("utf-8", "replace")
            errors = tracebacks_in(text)
            plain = [
                line.strip()[:200]
                for line in text.splitlines()
                if " ERROR " in line and "Traceback" not in line
            ]
            return errors or plain
        return []


class LogCapture(logging.Handler):
    """ERROR records of an in-process server, as LogFile gives them for a process."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            text = "".join(traceback.format_exception(*record.exc_info))
            self.lines += tracebacks_in("Traceback (most recent call last):\n" + text)
        else:
            self.lines.append(record.getMessage()[:200])

    def new_errors(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


# ---- servers under fuzz ----------------------------------------------------------------------


class Server(Protocol):
    name: str
    host: str
    port: int
    pid: int

    def new_errors(self) -> list[str]: ...
    def alive(self) -> bool: ...
    def kill(self) -> None: ...
    async def restart(self) -> bool: ...


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    """A process's resident set (VmRSS) or its peak (VmHWM), from /proc; 0 once it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


class ProcessServer:
    """A server in a child process this code started (and so may kill, by its PID), logging to a
    file; ``restart`` replaces it with a fresh one on a new free port."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]],
        log_dir: Path,
        env: dict[str, str] | None = None,
        ready_path: str = "/ready",
        start_timeout_s: float = 180.0,
    ) -> None:
        self.name = name
        self.host = "127.0.0.1"
        self.port = 0
        self.pid = 0
        self._command = command
        self._log_dir = log_dir
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._ready_path = ready_path
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._starts = 0
        self.log: LogFile | None = None
        self._earlier_errors: list[str] = []  # a replaced process's last log lines

    def start(self) -> ProcessServer:
        self.port = free_port()
        self._starts += 1
        path = self._log_dir / f"{self.name}-{self._starts}.log"
        with path.open("wb") as log:
            self._proc = subprocess.Popen(
                self._command(self.port),
                cwd=_REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
            )
        self.pid = self._proc.pid
        self.log = LogFile(path)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        url = f"http://{self.host}:{self.port}{self._ready_path}"
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._proc.returncode}: {self.tail()}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(url, timeout=2) as reply,
            ):
                if reply.status == 200:
                    return
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"{self.name} not ready after {self._start_timeout_s} s: {self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        if self.log is None:
            return ""
        return self.log.path.read_text(errors="replace")[-chars:]

    def new_errors(self) -> list[str]:
        errors, self._earlier_errors = self._earlier_errors, []
        return errors + (self.log.new_errors() if self.log else [])

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    async def restart(self) -> bool:
        self.kill()
        self._earlier_errors = self.new_errors()  # read with the finding that caused this
        await asyncio.to_thread(self.start)
        return True


def engine_command(
    model: Path | str, name: str, flags: tuple[str, ...]
) -> Callable[[int], list[str]]:
    """``python -m engine`` on a tiny model, as ProcessServer starts it."""

    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "engine", "--model", str(model), "--port", str(port),
            "--served-model-name", name, *flags,
        ]  # fmt: skip

    return command


GATEWAY_KEY_ENV = "FUZZ_CLIENT_KEY"
GATEWAY_ADMIN_ENV = "FUZZ_ADMIN_KEY"
GATEWAY_KEYS = {GATEWAY_KEY_ENV: "fuzz-client-key-7f3a", GATEWAY_ADMIN_ENV: "fuzz-admin-key-91c2"}


def gateway_document(upstream_url: str, dead_url: str) -> dict[str, Any]:
    """The fleet tests/fuzzing.py's gateway profile expects: m1 (alias default) on a working
    upstream, ``down`` on a port nothing listens on; one client key and an admin key (from
    GATEWAY_KEYS in the environment); client deadlines of 1 s, so that unfinished requests get
    their 408 within a short wait."""
    return {
        "gateway": {
            "health": {"interval_s": 0.5, "timeout_s": 0.5, "unhealthy_after": 1},
            "retries": {"attempts": 2, "backoff_ms": 5},
            "watch_config": False,
            "access_log": False,
            "clients": {"header_timeout_s": 1, "body_timeout_s": 1},
            "auth": {
                "admin_key_env": GATEWAY_ADMIN_ENV,
                "keys": [{"name": "fuzz", "key_env": GATEWAY_KEY_ENV}],
            },
        },
        "models": [
            {"name": "m1", "aliases": ["default"], "upstreams": [upstream_url]},
            {"name": "down", "upstreams": [dead_url]},
        ],
    }


# ---- the run ---------------------------------------------------------------------------------


@dataclass
class Finding:
    seed: int
    index: int
    label: str
    verdict: str
    status: int | None
    detail: str
    request: str
    log: list[str]
    probe: str  # the valid request right after: "ok", or what went wrong

    def cause(self) -> str:
        """What findings are grouped by: the server's traceback when it logged one, else what was
        fuzzed without the values (``field n`` for ``field n <- int 2**64``)."""
        if self.log:
            return self.log[0]
        return "; ".join(part.split(" <- ")[0] for part in self.label.split("; "))


@dataclass
class Report:
    server: str
    seed: int
    planned: int
    run: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    verdicts: collections.Counter[str] = field(default_factory=collections.Counter)
    findings: list[Finding] = field(default_factory=list)
    logged_without_finding: list[str] = field(default_factory=list)
    rss_before: int = 0
    rss_after: int = 0
    rss_peak: int = 0
    rss_cap: int | None = None
    restarts: int = 0
    wall_s: float = 0.0
    stopped_early: str | None = None

    @property
    def rss_growth(self) -> int:
        return self.rss_after - self.rss_before

    def groups(self) -> list[dict[str, Any]]:
        """Findings by (verdict, status, cause), largest group first."""
        grouped: dict[tuple[str, str, str], list[Finding]] = collections.defaultdict(list)
        for f in self.findings:
            grouped[(f.verdict, str(f.status), f.cause())].append(f)
        out = []
        for (verdict, status, cause), items in sorted(grouped.items(), key=lambda kv: -len(kv[1])):
            first = items[0]
            labels = collections.Counter(f.label for f in items)
            out.append(
                {
                    "verdict": verdict,
                    "status": status,
                    "cause": cause,
                    "count": len(items),
                    "labels": dict(labels.most_common(6)),
                    "reproduce": {"seed": first.seed, "index": first.index, "server": self.server},
                    "indices": [f.index for f in items[:20]],
                    "request": first.request,
                    "detail": first.detail,
                    "probe_after": first.probe,
                }
            )
        return out

    def figures(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "seed": self.seed,
            "cases_planned": self.planned,
            "cases": self.run,
            "statuses": dict(sorted(self.statuses.items())),
            "verdicts": dict(sorted(self.verdicts.items())),
            "findings": len(self.findings),
            "5xx": self.verdicts["5xx"],
            "non_json_errors": self.verdicts["non-JSON error body"],
            "hangs": self.verdicts["hang"],
            "rss_mib": {
                "before": round(self.rss_before / MIB, 1),
                "after": round(self.rss_after / MIB, 1),
                "growth": round(self.rss_growth / MIB, 1),
                "peak": round(self.rss_peak / MIB, 1),
                "cap": round(self.rss_cap / MIB, 1) if self.rss_cap else None,
            },
            "restarts": self.restarts,
            "wall_s": round(self.wall_s, 2),
            "stopped_early": self.stopped_early,
            "groups": self.groups(),
            "errors_logged_without_finding": self.logged_without_finding[:20],
        }

    def summary(self, examples: int = 12) -> str:
        f = self.figures()
        lines = [
            f"{self.server}: {self.run}/{self.planned} cases (seed {self.seed}) in {f['wall_s']} s,"
            f" {len(self.findings)} findings; restarts {self.restarts}"
            + (f"; stopped early: {self.stopped_early}" if self.stopped_early else ""),
            "  statuses: " + ", ".join(f"{k}: {v}" for k, v in f["statuses"].items()),
            "  verdicts: " + ", ".join(f"{k}: {v}" for k, v in f["verdicts"].items()),
            "  RSS MiB: before {before}, after {after} (growth {growth}), peak {peak}".format(
                **f["rss_mib"]
            ),
        ]
        groups = f["groups"]
        if groups:
            lines.append(f"  findings by cause ({len(groups)} groups):")
        for g in groups[:examples]:
            labels = "; ".join(f"{k} x{v}" for k, v in g["labels"].items())
            r = g["reproduce"]
            lines += [
                f"  - {g['count']} x {g['verdict']} {g['status']}: {g['cause']}",
                f"      fuzzed: {labels}"[:400],
                f"      reproduce: make_case({r['server']}, seed={r['seed']}, index={r['index']})"
                f" -> {g['request'][:200]}",
                f"      answer: {g['detail'][:200]}; valid request after: {g['probe_after']}",
                f"      indices: {g['indices']}",
            ]
        if len(groups) > examples:
            lines.append(f"  ... and {len(groups) - examples} more groups")
        return "\n".join(lines)


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
        report.rss_after = rss_bytes(self.server.pid)
        report.rss_peak = max(report.rss_peak, rss_bytes(self.server.pid, "VmHWM"))
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
        report.rss_peak = max(report.rss_peak, rss_bytes(self.server.pid))
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
        report.rss_before = rss_bytes(self.server.pid)
        headroom = self.settings.rss_headroom
        report.rss_cap = report.rss_before + headroom if headroom is not None else None
        self._rss_cap = report.rss_cap

    async def _watch_rss(self) -> None:
        if self.settings.rss_headroom is None or self.server.pid == os.getpid():
            return
        while True:
            await asyncio.sleep(0.05)
            rss = rss_bytes(self.server.pid)
            if self._rss_cap is not None and rss > self._rss_cap and self.server.alive():
                self._kills[self._last_index] = rss
                self.server.kill()
