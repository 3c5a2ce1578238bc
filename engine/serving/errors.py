"""Errors only the server raises: what it answers when the engine cannot serve a request."""

from __future__ import annotations

from engine.errors import EngineError

# What a 503 that means "come back later" tells clients (the OpenAI SDKs, the gateway's retries)
# to wait, in seconds: the queue moves every engine step, and a load or a drain ends within
# seconds or sends the client to another replica; a short wait costs little either way.
RETRY_AFTER_S = 1


class ServiceUnavailableError(EngineError):
    """The engine cannot take this request now (loading, overloaded, sleeping, shutting down,
    dead)."""

    status = 503

    def __init__(self, message: str, code: str, retry_after_s: int | None = RETRY_AFTER_S) -> None:
        headers = {} if retry_after_s is None else {"Retry-After": str(retry_after_s)}
        super().__init__(message, code=code, headers=headers)


class EngineDeadError(EngineError):
    """The engine loop crashed while this request was in flight."""

    status = 500


class ModelNotFoundError(EngineError):
    """The request names a model this engine does not serve."""

    status = 404
