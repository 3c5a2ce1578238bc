"""Requests for features an external upstream lacks (models.yaml ``capabilities``), refused by the
gateway itself before proxying: a 400 in OpenAI's shape naming the field, where the upstream
might answer with its own error, or ignore the field and answer as if it had not been sent."""

from __future__ import annotations

from typing import Any

from common.errors import RequestRefused
from gateway.config import Capabilities

# The request fields that use each feature, in the order they are checked.
TOOL_FIELDS = ("tools", "functions")
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def check_capabilities(payload: dict[str, Any], capabilities: Capabilities, model: str) -> None:
    """Raise a 400 for the first field ``payload`` uses that ``capabilities`` lacks."""
    if not capabilities.tools:
        _refuse_any(payload, TOOL_FIELDS, "tool calling", model)
    if not capabilities.structured_outputs:
        _refuse_any(payload, STRUCTURED_FIELDS, "structured outputs", model)


def _refuse_any(payload: dict[str, Any], fields: tuple[str, ...], feature: str, model: str) -> None:
    for name in fields:
        if _uses(payload, name):
            raise RequestRefused(
                400,
                f"Model '{model}' does not support {feature}: remove '{name}'.",
                code="unsupported_parameter",
                param=name,
            )


def _uses(payload: dict[str, Any], name: str) -> bool:
    value = payload.get(name)
    if name == "response_format":  # type text is the default: no constraint
        return isinstance(value, dict) and value.get("type") not in (None, "text")
    return value is not None and value != []
