"""The request fields that constrain the output, parsed into one StructuredOutput (or a 400
naming the field): OpenAI's response_format, vLLM's structured_outputs and guided_* fields."""

from __future__ import annotations

import json

import pytest

from engine.core.sampling_params import StructuredOutput
from engine.errors import InvalidRequestError
from engine.serving.requests import RequestLimits, parse_chat_request, parse_completion_request
from engine.serving.structured_fields import structured_param

LIMITS = RequestLimits(max_model_len=512, max_n=8, vocab_size=512, longest_token_chars=16)
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
SCHEMA_TEXT = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'


def chat(**fields: object) -> StructuredOutput | None:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_chat_request(body, LIMITS).params.structured


def completion(**fields: object) -> StructuredOutput | None:
    return parse_completion_request({"prompt": "Hi", **fields}, LIMITS).params.structured


def json_schema_format(**spec: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, **spec}}


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": None}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": json_schema_format()}, StructuredOutput("json_schema", SCHEMA_TEXT)),
        (
            {"response_format": json_schema_format(strict=True, description="A person")},
            StructuredOutput("json_schema", SCHEMA_TEXT),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", SCHEMA_TEXT)),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutput("json_schema", SCHEMA_TEXT),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
        (
            {"structured_outputs": {"choice": ["ja", "nein"]}},
            StructuredOutput("choice", '["ja", "nein"]'),
        ),
        (
            {"structured_outputs": {"grammar": 'start: "x"'}},
            StructuredOutput("grammar", 'start: "x"'),
        ),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        (  # vLLM options that change nothing here are accepted
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            StructuredOutput("regex", "a"),
        ),
        ({"guided_json": SCHEMA}, StructuredOutput("json_schema", SCHEMA_TEXT)),
        ({"guided_regex": "[0-9]"}, StructuredOutput("regex", "[0-9]")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput("choice", '["a", "b"]')),
        ({"guided_grammar": 'start: "y"'}, StructuredOutput("grammar", 'start: "y"')),
        (  # a text response_format constrains nothing, so it combines with anything
            {"response_format": {"type": "text"}, "guided_regex": "x"},
            StructuredOutput("regex", "x"),
        ),
    ],
)
def test_constraints(parse, fields, expected) -> None:
    assert parse(**fields) == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "json_object"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": json_schema_format(name="a b")}, "response_format.json_schema.name"),
        (
            {"response_format": json_schema_format(name="x" * 65)},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": json_schema_format(schema=None)},
            "response_format.json_schema.schema",
        ),
        ({"response_format": json_schema_format(schema=[1])}, "response_format.json_schema.schema"),
        (
            {"response_format": json_schema_format(strict="yes")},
            "response_format.json_schema.strict",
        ),
        (
            {"response_format": json_schema_format(description=5)},
            "response_format.json_schema.description",
        ),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": [""]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 5}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        (
            {"structured_outputs": {"regex": "a", "structural_tag": "{}"}},
            "structured_outputs.structural_tag",
        ),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_json": [1]}, "guided_json"),
        # JSON text nested past Python's recursion limit (the body's own nesting cap stops at
        # the string): once a 500
        ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json"),
        # two constraints at once
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
@pytest.mark.parametrize("parse", [chat, completion])
def test_bad_fields_are_400s_naming_them(parse, fields, param) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse(**fields)
    assert caught.value.status == 400
    assert caught.value.param == param, caught.value.message


def test_two_constraints_name_both() -> None:
    with pytest.raises(InvalidRequestError, match="response_format and guided_regex"):
        chat(response_format={"type": "json_object"}, guided_regex="a")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "text"}, "structured_outputs": {}}, "structured_outputs"),
        ({"guided_grammar": "x"}, "guided_grammar"),
        ({"tools": []}, "tool_choice"),  # a constraint no field carried: a forced tool call's
    ],
)
def test_structured_param(body, param) -> None:
    assert structured_param(body) == param
