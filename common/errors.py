"""The refusal the shared HTTP code raises; each server's error middleware answers it in its own
OpenAI error shape (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

_EXCERPT_CHARS = 128


class RequestRefused(Exception):
    """A request refused before any server-specific work: ``status``, an OpenAI error ``code``,
    headers to send (e.g. ``Retry-After``), and whether the connection must close because the
    request's body was not read to its end."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.close = close


def excerpt(text: str, limit: int = _EXCERPT_CHARS) -> str:
    """A client-controlled string as an error message may quote it: at most ``limit``
    characters, so an answer never grows with what the client sent."""
    return text if len(text) <= limit else text[:limit] + "…"
