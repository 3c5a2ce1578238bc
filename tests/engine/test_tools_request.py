"""tools / tool_choice / parallel_tool_calls: every bad shape is a 400 naming its path, and the
JSON Schema of a forced call accepts exactly the calls it should (checked by jsonschema, an
independent validator)."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest

from engine.errors import InvalidRequestError
from engine.serving.tools.constraint import forced_call_constraint, forced_call_schema
from engine.serving.tools.request import parse_tool_request

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters at all


def _body(**fields: Any) -> dict:
    return {"tools": [WEATHER, TIME], **fields}


def _with_function(**function: Any) -> dict:
    tool = copy.deepcopy(WEATHER)
    tool["function"].update(function)
    return {"tools": [tool]}


BAD = [
    ({"tools": []}, "tools"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tools": [WEATHER, {"type": "code_interpreter"}]}, "tools[1].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
    (_with_function(name="has space"), "tools[0].function.name"),
    (_with_function(name="x" * 65), "tools[0].function.name"),
    (_with_function(name=""), "tools[0].function.name"),
    (_with_function(name=5), "tools[0].function.name"),
    (_with_function(description=5), "tools[0].function.description"),
    (_with_function(strict="yes"), "tools[0].function.strict"),
    (_with_function(parameters="object"), "tools[0].function.parameters"),
    (_with_function(parameters={"type": "string"}), "tools[0].function.parameters"),
    (
        _with_function(parameters={"type": "object", "properties": 5}),
        "tools[0].function.parameters",
    ),
    (
        _with_function(parameters={"type": "object", "required": "city"}),
        "tools[0].function.parameters",
    ),
    (_with_function(parameters={"$schema": ["x"]}), "tools[0].function.parameters"),
    (_with_function(parameters={"$schema": 5}), "tools[0].function.parameters"),
    (_with_function(parameters={"$schema": "https://x.example/s"}), "tools[0].function.parameters"),
    (
        _with_function(parameters={"type": "object", "properties": {"a": {"pattern": "("}}}),
        "tools[0].function.parameters",
    ),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    (_body(tool_choice="always"), "tool_choice"),
    (_body(tool_choice=5), "tool_choice"),
    (_body(tool_choice={"type": "allowed_tools"}), "tool_choice.type"),
    (_body(tool_choice={"type": "function"}), "tool_choice.function"),
    (_body(tool_choice={"type": "function", "function": {"name": 5}}), "tool_choice.function"),
    (
        _body(tool_choice={"type": "function", "function": {"name": "get_news"}}),
        "tool_choice.function.name",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    (_body(parallel_tool_calls="no"), "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
]


def checked(body: dict) -> Any:
    """The request's tools, checked in full: the fields (parse_tool_request, on the event loop),
    then the parameters' metaschemas (with the prompt, on the prompt thread)."""
    request = parse_tool_request(body)
    if request is not None:
        request.check_parameter_schemas()
    return request


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_tool_fields_are_400_naming_the_path(body, param):
    with pytest.raises(InvalidRequestError) as raised:
        checked(body)
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message


def test_defaults():
    assert parse_tool_request({}) is None
    assert parse_tool_request({"tool_choice": "none"}) is None  # OpenAI allows it without tools
    request = parse_tool_request(_body())
    assert request is not None
    assert (request.mode, request.forced, request.parallel) == ("auto", None, True)
    assert request.names == {"get_weather", "get_time"}
    # No parameters: OpenAI's empty object.
    assert request.tools[1].parameters == {"type": "object", "properties": {}}
    assert request.tools[0].as_openai() == WEATHER


def test_choices():
    named = {"type": "function", "function": {"name": "get_time"}}
    request = parse_tool_request(_body(tool_choice=named, parallel_tool_calls=False))
    assert request is not None and request.mode == "named" and not request.parallel
    assert request.forced is not None and request.forced.name == "get_time"
    for mode in ("auto", "none", "required"):
        assert parse_tool_request(_body(tool_choice=mode)).mode == mode


def test_a_schema_of_an_older_draft_is_checked_by_its_own_metaschema():
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object"}
    assert checked(_with_function(parameters=draft4)) is not None
    with pytest.raises(InvalidRequestError):  # draft 4's exclusiveMinimum is a boolean
        checked(_with_function(parameters={**draft4, "properties": {"n": {"exclusiveMinimum": 3}}}))


def test_metaschema_checks_wait_for_the_prompt_and_are_remembered(monkeypatch):
    """The metaschema check is pure Python (about a second for 100 KB of schema): not on the
    event loop's parse, and once per distinct schema."""
    calls = []
    real = jsonschema.Draft202012Validator.check_schema
    monkeypatch.setattr(
        jsonschema.Draft202012Validator,
        "check_schema",
        classmethod(lambda cls, schema, **kw: calls.append(schema) or real(schema, **kw)),
    )
    parameters = {"type": "object", "properties": {"never_seen_before": {"type": "integer"}}}
    request = parse_tool_request(_with_function(parameters=parameters))
    assert request is not None and calls == []
    request.check_parameter_schemas()
    request.check_parameter_schemas()
    assert calls == [parameters]


# ---- the forced call's schema ------------------------------------------------------------


def _validator(body: dict) -> jsonschema.Validator:
    request = parse_tool_request(body)
    assert request is not None
    constraint = forced_call_constraint(request)
    assert constraint is not None and constraint.kind == "json_schema"
    schema = json.loads(constraint.value)
    assert schema == forced_call_schema(request)
    # name before arguments in every call object: the order the decoder writes them in
    calls = schema["items"]["anyOf"] if schema.get("type") == "array" else [schema]
    assert all(list(call["properties"]) == ["name", "arguments"] for call in calls)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


PARIS = {"name": "get_weather", "arguments": {"city": "Paris"}}
NOW = {"name": "get_time", "arguments": {}}


def test_required_accepts_one_or_more_calls_of_declared_tools():
    validator = _validator(_body(tool_choice="required"))
    assert validator.is_valid([PARIS])
    assert validator.is_valid([PARIS, NOW, {**PARIS, "arguments": {"city": "Oslo", "unit": "C"}}])
    assert not validator.is_valid([])
    assert not validator.is_valid(PARIS)
    assert not validator.is_valid([{"name": "get_news", "arguments": {}}])
    assert not validator.is_valid([{"name": "get_weather", "arguments": {}}])  # city required
    assert not validator.is_valid([{**PARIS, "arguments": {"city": "Paris", "unit": "K"}}])
    assert not validator.is_valid([{"name": "get_weather"}])
    assert not validator.is_valid([{**PARIS, "id": "x"}])


def test_required_without_parallel_calls_allows_one():
    validator = _validator(_body(tool_choice="required", parallel_tool_calls=False))
    assert validator.is_valid([PARIS]) and not validator.is_valid([PARIS, NOW])


def test_named_is_one_call_of_that_tool():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    validator = _validator(_body(tool_choice=choice))
    assert validator.is_valid(PARIS)
    assert not validator.is_valid([PARIS]) and not validator.is_valid(NOW)


def test_auto_and_none_are_not_constrained():
    for mode in ("auto", "none"):
        request = parse_tool_request(_body(tool_choice=mode))
        assert request is not None and forced_call_constraint(request) is None


def test_definitions_move_to_the_root_where_their_references_point():
    parameters = {
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/place"}},
        "required": ["place"],
        "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
    body = _with_function(parameters=parameters)
    validator = _validator({**body, "tool_choice": "required"})
    assert validator.is_valid([{"name": "get_weather", "arguments": {"place": {"city": "A"}}}])
    assert not validator.is_valid([{"name": "get_weather", "arguments": {"place": {"city": 5}}}])


def test_conflicting_definitions_are_refused():
    def tool(name: str, kind: str) -> dict:
        parameters = {"type": "object", "$defs": {"x": {"type": kind}}}
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    request = parse_tool_request(
        {"tools": [tool("a", "string"), tool("b", "integer")], "tool_choice": "required"}
    )
    with pytest.raises(InvalidRequestError) as raised:
        forced_call_constraint(request)
    assert raised.value.param == "tools"
