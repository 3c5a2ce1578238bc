"""Tool calling and structured outputs through the gateway: their fields reach the upstream
unchanged (streamed or not, model renamed or not), and a model whose ``capabilities`` lack a
feature gets the gateway's own 400 naming the field, without the upstream ever seeing it."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import fleet

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": True,
        },
    }
]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FIELDS = {
    "tools": TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": False,
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    "structured_outputs": {"regex": "[0-9]+"},
}
MESSAGES = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("upstream_model", [None, "org/Renamed"])
async def test_tool_and_structured_fields_pass_through_unchanged(
    start_gateway, fresh_upstreams, stream, upstream_model
):
    doc = fleet([fresh_upstreams[0].url])
    if upstream_model:
        doc["models"][0]["upstream_model"] = upstream_model
    gw = await start_gateway(doc)
    body = {"model": "m1", "messages": MESSAGES, "stream": stream, **FIELDS}
    resp = await gw.post("/v1/chat/completions", body)
    assert resp.status == 200, await resp.text()
    await resp.read()
    sent = fresh_upstreams[0].stats()["last_body"]
    for name, value in [("messages", MESSAGES), *FIELDS.items()]:
        assert sent[name] == value, name
    assert sent["model"] == (upstream_model or "m1")


def _limited(url: str, **capabilities: bool) -> dict:
    doc = fleet([url])
    doc["models"][0]["capabilities"] = capabilities
    return doc


REFUSED = [
    ({"tools": False}, {"tools": TOOLS}, "tools"),
    ({"tools": False}, {"functions": [TOOLS[0]["function"]]}, "functions"),
    (
        {"structured_outputs": False},
        {"response_format": FIELDS["response_format"]},
        "response_format",
    ),
    (
        {"structured_outputs": False},
        {"response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        {"structured_outputs": False},
        {"structured_outputs": {"choice": ["a"]}},
        "structured_outputs",
    ),
    ({"structured_outputs": False}, {"guided_json": SCHEMA}, "guided_json"),
]


@pytest.mark.parametrize(("capabilities", "fields", "param"), REFUSED)
async def test_a_missing_capability_is_the_gateways_400(
    start_gateway, fresh_upstreams, capabilities, fields, param
):
    gw = await start_gateway(_limited(fresh_upstreams[0].url, **capabilities))
    before = fresh_upstreams[0].stats()["requests"]
    resp = await gw.chat(**fields)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["code"] == "unsupported_parameter" and "'m1'" in error["message"]
    assert fresh_upstreams[0].stats()["requests"] == before  # never proxied


async def test_what_a_capability_does_not_cover_still_passes(start_gateway, fresh_upstreams):
    gw = await start_gateway(_limited(fresh_upstreams[0].url, tools=False))
    for fields in (
        {"response_format": FIELDS["response_format"]},  # structured outputs are not tools
        {"tools": None},
        {"tools": []},
        {"tool_choice": "none"},
    ):
        resp = await gw.chat(**fields)
        assert resp.status == 200, (fields, await resp.text())
    gw = await start_gateway(_limited(fresh_upstreams[0].url, structured_outputs=False))
    for fields in ({"response_format": {"type": "text"}}, {"tools": TOOLS}):
        resp = await gw.chat(**fields)
        assert resp.status == 200, (fields, await resp.text())
    assert fresh_upstreams[0].stats()["last_body"]["tools"] == TOOLS
