"""The request fields that constrain the output (structured outputs) -> one StructuredOutput.

OpenAI's ``response_format`` (text, json_object, json_schema), vLLM's ``structured_outputs``
(exactly one of json, regex, choice, grammar, json_object) and vLLM's older top-level
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one field may
constrain a request. Only the fields' shapes are checked here, on the event loop; whether a schema,
regex or grammar compiles is known once the engine compiled it (engine.structured), which the
server awaits before accepting the request.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.core.sampling_params import StructuredOutput
from engine.serving.request_fields import bad_field, get_field

RESPONSE_FORMAT = "response_format"
STRUCTURED_OUTPUTS = "structured_outputs"
# vLLM's structured_outputs keys, and the older top-level fields, by constraint kind
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_GUIDED = {f"guided_{key}": kind for key, kind in _KINDS.items()}
# vLLM structured_outputs options this engine cannot honour (a 400 rather than ignoring them)
_UNSUPPORTED_OPTIONS = ("structural_tag", "whitespace_pattern", "disable_additional_properties")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def parse_structured(body: dict) -> StructuredOutput | None:
    """The constraint the body asks for, if any; a 400 naming the field for a malformed one or
    for two at once."""
    found = [
        (name, constraint)
        for name, constraint in (
            (RESPONSE_FORMAT, _response_format(body)),
            (STRUCTURED_OUTPUTS, _structured_outputs(body)),
            *((name, _guided(body, name, kind)) for name, kind in _GUIDED.items()),
        )
        if constraint is not None
    ]
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_field(
            found[1][0],
            f"cannot be combined with {found[0][0]}: {names} both constrain the output; send one",
        )
    return found[0][1] if found else None


def structured_param(body: dict) -> str:
    """The field that carried a request's constraint, as its errors name it (tool_choice when
    none did: the constraint came from a required or named tool call)."""
    for name in (RESPONSE_FORMAT, STRUCTURED_OUTPUTS, *_GUIDED):
        if body.get(name) is not None and not _is_text_format(body, name):
            return name
    return "tool_choice"


def _is_text_format(body: dict, name: str) -> bool:
    value = body.get(name)
    return name == RESPONSE_FORMAT and isinstance(value, dict) and value.get("type") == "text"


def _schema_text(schema: dict) -> str:
    # Key order kept: a schema's property order is the order the output's fields are generated in.
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _response_format(body: dict) -> StructuredOutput | None:
    fmt = get_field(body, RESPONSE_FORMAT, "dict")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise bad_field(RESPONSE_FORMAT, "'type' must be 'text', 'json_object' or 'json_schema'")
    spec = fmt.get("json_schema")
    path = f"{RESPONSE_FORMAT}.json_schema"
    if not isinstance(spec, dict):
        raise bad_field(path, "must be an object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_field(f"{path}.name", "must be 1 to 64 letters, digits, underscores or dashes")
    # Checked, not used: the description only informs a model prompted with it, and the
    # grammar holds the output to the schema whether strict is set or not.
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise bad_field(f"{path}.description", "must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_field(f"{path}.strict", "must be a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_field(f"{path}.schema", "must be a JSON Schema object")
    return StructuredOutput("json_schema", _schema_text(schema))


def _structured_outputs(body: dict) -> StructuredOutput | None:
    options = get_field(body, STRUCTURED_OUTPUTS, "dict")
    if options is None:
        return None
    for option in _UNSUPPORTED_OPTIONS:
        if options.get(option):
            raise bad_field(f"{STRUCTURED_OUTPUTS}.{option}", "is not supported by this engine")
    given = [key for key in (*_KINDS, "json_object") if options.get(key) not in (None, False)]
    if len(given) != 1:
        raise bad_field(
            STRUCTURED_OUTPUTS,
            "must set exactly one of json, regex, choice, grammar or json_object"
            + (f", got {', '.join(given)}" if given else ""),
        )
    key = given[0]
    if key == "json_object":
        if options[key] is not True:
            raise bad_field(f"{STRUCTURED_OUTPUTS}.json_object", "must be a boolean")
        return StructuredOutput("json_object")
    return _constraint(_KINDS[key], options[key], f"{STRUCTURED_OUTPUTS}.{key}")


def _guided(body: dict, name: str, kind: str) -> StructuredOutput | None:
    value = body.get(name)
    return None if value is None else _constraint(kind, value, name)


def _constraint(kind: str, value: Any, path: str) -> StructuredOutput:
    """One constraint of `kind` from its field's value (at `path` in the body)."""
    if kind == "json_schema":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise bad_field(path, f"is not valid JSON: {error}") from None
            except RecursionError:  # the body's nesting limit does not reach inside strings
                raise bad_field(path, "is nested too deeply") from None
        if not isinstance(value, dict):
            raise bad_field(path, "must be a JSON Schema object (or its JSON text)")
        return StructuredOutput(kind, _schema_text(value))
    if kind == "choice":
        if not (
            isinstance(value, list)
            and value
            and all(isinstance(choice, str) and choice for choice in value)
        ):
            raise bad_field(path, "must be a non-empty array of non-empty strings")
        return StructuredOutput(kind, json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise bad_field(path, "must be a non-empty string")
    return StructuredOutput(kind, value)
