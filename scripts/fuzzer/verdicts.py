"""Judging one answer: the verdict and its detail.

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
- ``RSS over cap`` (given by scripts/fuzzer/runner.py): the server process passed the RSS cap
  during a case; the runner kills it (only a process it started) and starts a fresh one.
"""

from __future__ import annotations

import contextlib
import json

from scripts.fuzzer.exchange import Answer
from scripts.fuzzer.request import Case

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
