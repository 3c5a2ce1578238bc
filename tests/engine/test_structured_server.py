"""Structured outputs through a real ``python -m engine`` process on the tiny Llama: a bad
constraint is a 400 before any streaming, OpenAI's and vLLM's request shapes, streaming with n,
logprobs and usage, and the official SDK's ``chat.completions.parse`` with a Pydantic model."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.engine.server_http import CHAT, COMPLETIONS, chat_body, post, stream
from tests.server_utils import EngineProcess

pytestmark = pytest.mark.timeout(240)

SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["verdict", "score"],
    "additionalProperties": False,
}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


class Answer(pydantic.BaseModel):
    verdict: Literal["yes", "no", "maybe"]
    confidence: int = pydantic.Field(ge=0, le=10)
    tags: list[Literal["red", "green"]] = pydantic.Field(max_length=2)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    proc = EngineProcess(
        tiny_llama_dir, "--kv-cache-memory", "16MiB", "--max-model-len", "512", "--num-threads", "1"
    ).wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


# ---- refusals: before any streaming ----


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"response_format": response_format({"type": "object", "required": "a"})},
            "response_format",
            "invalid at $.required",
        ),
        (
            {"response_format": response_format({"properties": {"x": {"not": {}}}})},
            "response_format",
            "not (at $.properties.x.not)",
        ),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "unclosed group"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "unknown name"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "cannot be combined with response_format",
        ),
    ],
)
async def test_bad_constraints_are_400s(engine, streaming, fields, param, message) -> None:
    body = chat_body("Hi", max_tokens=8, stream=streaming, **fields)
    status, reply = await post(engine.url + CHAT, body)
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"], error["message"]


# ---- shapes that work ----


async def test_streaming_n_logprobs_and_usage(engine) -> None:
    body = chat_body(
        "Hi",
        max_tokens=60,
        n=2,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
        response_format=response_format(SCHEMA),
    )
    events = await stream(engine.url + CHAT, body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    texts, finishes, logprob_count = {0: "", 1: ""}, {}, {0: 0, 1: 0}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice.get("logprobs"):
                logprob_count[choice["index"]] += len(choice["logprobs"]["content"])
            if choice.get("finish_reason"):
                finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "stop", 1: "stop"}
    for index in (0, 1):
        jsonschema.validate(json.loads(texts[index]), SCHEMA)
        assert logprob_count[index] > 0
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == sum(logprob_count.values())


async def test_completions_with_vllm_fields(engine) -> None:
    prompt = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 30}
    pattern = r"[0-9]{3}-[0-9]{4}"
    status, reply = await post(
        engine.url + COMPLETIONS, {**prompt, "structured_outputs": {"regex": pattern}}
    )
    assert status == 200, reply
    assert re.fullmatch(pattern, reply["choices"][0]["text"])
    status, reply = await post(
        engine.url + COMPLETIONS, {**prompt, "guided_choice": ["up", "down"]}
    )
    assert status == 200 and reply["choices"][0]["text"] in ("up", "down")


def test_sdk_parse_with_a_pydantic_model(client) -> None:
    completion = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Judge this."}],
        response_format=Answer,
        max_tokens=80,
        temperature=0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Answer)
    assert message.parsed == Answer.model_validate_json(message.content)


def test_sdk_json_schema_and_extra_body(client) -> None:
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        response_format=response_format(SCHEMA),
        max_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
        max_tokens=10,
    )
    assert reply.choices[0].message.content in ("left", "right")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            response_format=response_format({"type": "array", "uniqueItems": True}),
            stream=True,
        )
    assert "uniqueItems" in caught.value.message
