"""Typed errors that the HTTP layer maps onto OpenAI-style error responses."""

from __future__ import annotations

from collections.abc import Mapping


class EngineError(Exception):
    """Base class for errors the engine reports to callers."""

    status: int = 500
    error_type: str | None = None  # None: the status's OpenAI type (common/errors.py)

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,  # sent with the error answer
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers: Mapping[str, str] = headers or {}


class InvalidRequestError(EngineError):
    """A request parameter is invalid (HTTP 400)."""

    status = 400


class ModelLoadError(EngineError):
    """The model cannot be loaded: missing path, unsupported architecture, missing package."""

    error_type = "model_load_error"


class CacheTooSmallError(EngineError):
    """The KV cache budget cannot hold even one max_model_len sequence."""

    error_type = "cache_too_small"


class EngineBusyError(EngineError):
    """The engine cannot sleep while requests are in flight or queued (HTTP 409): drain first."""

    status = 409

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_busy")


class EngineSleepingError(EngineError):
    """The engine is asleep (weights and KV cache released) and takes no requests (HTTP 503)."""

    status = 503

    def __init__(self, message: str = "engine is sleeping: POST /wake_up first") -> None:
        super().__init__(message, code="engine_sleeping")


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
