"""The JSON Schema that makes a reply a tool call, for tool_choice ``required`` or a named function
(vLLM's approach): the engine's constrained decoding generates only text of this schema, so the
calls always parse and their arguments always validate against the tools' parameters.

- ``required``: an array (at least one call; at most one without ``parallel_tool_calls``) of
  ``{"name": <a declared tool>, "arguments": <that tool's parameters>}``;
- named: that one object, for the forced tool.

The tools' ``$defs`` / ``definitions`` move to the root, where their ``#/$defs/...`` references
point once the parameters sit inside this schema."""

from __future__ import annotations

import json
from typing import Any

from engine.core.sampling_params import StructuredOutput
from engine.serving.request_fields import bad_field
from engine.serving.tools.request import Tool, ToolRequest

_DEFINITION_KEYS = ("$defs", "definitions")


def call_schema(tool: Tool, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """One call of ``tool``: its name, and arguments of its parameters' schema."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            "arguments": tool.parameters if parameters is None else parameters,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_schema(request: ToolRequest) -> dict[str, Any] | None:
    """The schema a ``required`` or named reply must follow; None for ``auto`` and ``none``."""
    if request.mode == "required":
        tools = request.tools
    elif request.mode == "named":
        assert request.forced is not None
        tools = (request.forced,)
    else:
        return None
    definitions: dict[str, dict[str, Any]] = {}
    calls = [call_schema(tool, _hoist_definitions(tool, definitions)) for tool in tools]
    if request.mode == "named":
        schema = calls[0]
    else:
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not request.parallel:
            schema["maxItems"] = 1
    schema.update({key: value for key, value in definitions.items() if value})
    return schema


def forced_call_constraint(request: ToolRequest) -> StructuredOutput | None:
    """``forced_call_schema`` as the engine's constraint. Its keys keep their order (not sorted):
    the decoder writes properties in schema order, and "name" before "arguments" lets a stream
    open the call before its arguments arrive."""
    schema = forced_call_schema(request)
    if schema is None:
        return None
    return StructuredOutput("json_schema", json.dumps(schema))


def _hoist_definitions(tool: Tool, definitions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tool's parameters without their definitions, which join ``definitions`` (per key);
    two tools defining one name differently are refused (a reference could not tell them apart)."""
    parameters = dict(tool.parameters)
    for key in _DEFINITION_KEYS:
        own = parameters.pop(key, None)
        if not isinstance(own, dict):
            continue
        shared = definitions.setdefault(key, {})
        for name, definition in own.items():
            if shared.setdefault(name, definition) != definition:
                raise bad_field(
                    "tools",
                    f"tools define {key}/{name} differently; a forced tool call (tool_choice "
                    "'required') needs one meaning per definition name",
                )
    return parameters
