"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked as OpenAI
checks them: every bad shape is a 400 naming its path (``tools[2].function.name``).

The legacy ``functions`` / ``function_call`` fields are refused with a pointer to ``tools``
rather than mapped: OpenAI deprecated them, and half-supporting their reply shape
(``message.function_call``) would be a second tool protocol to keep true."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from common.errors import excerpt
from engine.serving.request_fields import bad_field, get_field

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # OpenAI's default

ChoiceMode = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON Schema of the arguments object
    strict: bool | None

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates take it: OpenAI's ``{"type": "function", ...}``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request declares and how the model may use them."""

    tools: tuple[Tool, ...]
    mode: ChoiceMode
    forced: Tool | None = None  # mode "named": the one tool it must call
    parallel: bool = True  # parallel_tool_calls: more than one call in a reply

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool.name for tool in self.tools)

    def check_parameter_schemas(self) -> None:
        """Every tool's parameters against its metaschema: pure Python that takes about a second
        for 100 KB of schema, so it runs with the prompt's templating, off the event loop, and
        a tool set sent again costs a lookup (the usual case: the same tools every turn)."""
        for i, tool in enumerate(self.tools):
            problem = _schema_problem(json.dumps(tool.parameters, sort_keys=True))
            if problem is not None:
                raise bad_field(f"tools[{i}].function.parameters", problem)


def parse_tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The body's tool fields, checked; None when it declares no tools."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad_field(legacy, "is deprecated and not supported; use 'tools' / 'tool_choice'")
    parallel = get_field(body, "parallel_tool_calls", "bool", True)
    raw_tools = body.get("tools")
    if raw_tools is None:
        choice = body.get("tool_choice")
        if choice is not None and choice != "none":
            raise bad_field("tool_choice", "is only allowed when 'tools' are specified")
        return None
    if not isinstance(raw_tools, list) or not raw_tools:
        raise bad_field("tools", "must be a non-empty array of tools")
    if len(raw_tools) > MAX_TOOLS:
        raise bad_field("tools", f"must hold at most {MAX_TOOLS} tools, got {len(raw_tools)}")
    tools: list[Tool] = []
    for i, raw in enumerate(raw_tools):
        tool = _tool(raw, f"tools[{i}]")
        if any(t.name == tool.name for t in tools):
            raise bad_field(f"tools[{i}].function.name", f"repeats the name {tool.name!r}")
        tools.append(tool)
    mode, forced = _tool_choice(body.get("tool_choice", "auto"), tools)
    return ToolRequest(tuple(tools), mode, forced, parallel)


def _tool(raw: Any, path: str) -> Tool:
    if not isinstance(raw, dict):
        raise bad_field(path, "must be an object")
    if raw.get("type") != "function":
        raise bad_field(f"{path}.type", f"must be 'function', got {excerpt(repr(raw.get('type')))}")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise bad_field(f"{path}.function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_field(
            f"{path}.function.name",
            f"must match ^[a-zA-Z0-9_-]{{1,64}}$, got {excerpt(repr(name))}",
        )
    description = _optional(function, "description", str, f"{path}.function.description")
    strict = _optional(function, "strict", bool, f"{path}.function.strict")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _NO_PARAMETERS
    else:
        _check_shape(parameters, f"{path}.function.parameters")
    return Tool(name, description, parameters, strict)


def _optional(holder: dict[str, Any], key: str, kind: type, path: str) -> Any:
    value = holder.get(key)
    if value is not None and not isinstance(value, kind):
        raise bad_field(path, f"must be {'a string' if kind is str else 'a boolean'}")
    return value


def _check_shape(schema: Any, path: str) -> None:
    """A JSON Schema object describing an object (its metaschema check comes with the prompt:
    ``ToolRequest.check_parameter_schemas``)."""
    if not isinstance(schema, dict):
        raise bad_field(path, "must be a JSON Schema object")
    if schema.get("type", "object") != "object":
        raise bad_field(path, f"must describe an object, got type {excerpt(repr(schema['type']))}")
    draft = schema.get("$schema")
    if "$schema" in schema and (
        not isinstance(draft, str)
        or jsonschema.validators.validator_for(schema, default=None) is None
    ):
        raise bad_field(path, f"$schema {excerpt(repr(draft))} names no JSON Schema draft")


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    """What is wrong with the schema in `text` by its metaschema (``$schema``'s draft, else
    2020-12), or None."""
    schema = json.loads(text)
    validator: Any = jsonschema.validators.validator_for(
        schema, default=jsonschema.Draft202012Validator
    )
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "".join(f"[{p!r}]" for p in error.absolute_path)
        return f"is not a valid JSON Schema: {excerpt(error.message)} at {where or 'the root'}"
    return None


def _tool_choice(raw: Any, tools: list[Tool]) -> tuple[ChoiceMode, Tool | None]:
    if raw in ("auto", "none", "required"):
        return raw, None
    if isinstance(raw, str):
        raise bad_field(
            "tool_choice",
            f"must be 'auto', 'none', 'required' or a function, got {excerpt(repr(raw))}",
        )
    if not isinstance(raw, dict):
        raise bad_field("tool_choice", "must be a string or an object")
    if raw.get("type") != "function":
        raise bad_field(
            "tool_choice.type", f"must be 'function', got {excerpt(repr(raw.get('type')))}"
        )
    function = raw.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_field("tool_choice.function", "must be an object with a string 'name'")
    name = function["name"]
    forced = next((tool for tool in tools if tool.name == name), None)
    if forced is None:
        raise bad_field("tool_choice.function.name", f"{excerpt(repr(name))} is not among 'tools'")
    return "named", forced
