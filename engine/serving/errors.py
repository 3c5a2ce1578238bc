"""Errors only the server raises: what it answers when the engine cannot serve a request."""

from __future__ import annotations

from engine.errors import EngineError


class EngineDeadError(EngineError):
    """The engine loop crashed while this request was in flight."""

    status = 500


class ModelNotFoundError(EngineError):
    """The request names a model this engine does not serve."""

    status = 404
