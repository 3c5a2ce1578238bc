"""``GET /admin/models`` for ``modelyard ps``: the gateway's URL, its admin key (from an environment
variable, as the gateway itself takes it; never printed), and every way the call fails as one line
(``PsError``)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

URL_ENV = "MODELYARD_URL"
DEFAULT_URL = "http://127.0.0.1:8000"  # gateway.listen's default
MAX_MESSAGE_CHARS = 200  # of a refusal's own message, quoted in ps's one line


class PsError(Exception):
    """Why ``modelyard ps`` cannot show the gateway, in one line."""


class Unreachable(PsError):
    """Nothing answered (refused, timed out): ``--watch`` shows it and asks again."""


def gateway_url(url: str | None) -> str:
    """``--url``, else ``$MODELYARD_URL``, else the default listen address; an OpenAI base URL
    (ending in ``/v1``) names the same gateway."""
    url = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/").removesuffix("/v1")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PsError(f"{url!r} is not a gateway URL: expected e.g. {DEFAULT_URL}")
    return url


def fetch_models(url: str, key_env: str, timeout_s: float) -> Any:
    """The gateway's ``/admin/models`` answer, parsed (its shape is rows.py's to check)."""
    key = os.environ.get(key_env)
    where = f"{url}/admin/models"
    request = urllib.request.Request(
        where, headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as refused:
        raise PsError(_refusal(refused, where, key_env, bool(key))) from None
    except urllib.error.URLError as failed:
        raise Unreachable(f"cannot reach the gateway at {url}: {_why(failed.reason)}") from None
    except OSError as failed:  # a timeout while reading the answer
        raise Unreachable(f"cannot reach the gateway at {url}: {_why(failed)}") from None
    except http.client.HTTPException as garbled:  # something that does not speak HTTP
        raise PsError(f"unexpected answer from {where}: not HTTP ({garbled!r})") from None
    try:
        return json.loads(body)
    except ValueError:
        raise PsError(f"unexpected answer from {where}: not JSON") from None


def _why(reason: object) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is `modelyard serve` running there?)"
    if isinstance(reason, TimeoutError):  # socket.timeout too
        return "no answer in time (--timeout)"
    if isinstance(reason, socket.gaierror):
        return f"unknown host ({reason.strerror})"
    return str(reason)


def _refusal(refused: urllib.error.HTTPError, where: str, key_env: str, sent_key: bool) -> str:
    code, message = _error(refused)
    said = f"{refused.code} {code}".strip() + (f": {message}" if message else "")
    if refused.code == 401 and not sent_key:
        return f"the gateway wants its admin key ({said}); set ${key_env} (or --admin-key-env NAME)"
    if refused.code == 401:
        return f"the gateway refused the admin key in ${key_env} ({said})"
    if refused.code == 404:
        return f"{where} answered 404: is a Modelyard gateway listening there?"
    return f"{where} answered {said}"


def _error(refused: urllib.error.HTTPError) -> tuple[str, str]:
    """The OpenAI-shaped error's code and message (one line, cut short), when it has one."""
    try:
        error = json.loads(refused.read())["error"]
        code, message = str(error.get("code") or ""), str(error.get("message") or "")
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return "", ""
    return code, " ".join(message.split())[:MAX_MESSAGE_CHARS]
