"""A tool loop with the official OpenAI SDK through the gateway to a real SmolLM2 engine: a forced
call (tool_choice required, then a named function, streamed and not) whose arguments validate
against the function's parameters (jsonschema), the result sent back, and a final answer.
SmolLM2's template ignores tools, so this runs the Hermes fallback prompt end to end; the
constraint (engine/structured) is what makes the calls deterministic and valid."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from common.net import free_port
from tests.gateway.serve_process import ServeProcess

pytestmark = [pytest.mark.smollm2, pytest.mark.timeout(600)]

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": PARAMETERS,
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time in a city."},
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
GREEDY = {"model": "smollm2", "temperature": 0, "max_tokens": 60}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[str]:
    model = {
        "name": "smollm2",
        "source": str(smollm2_gguf),
        "device": "cpu",
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "kv_cache_memory": "128MiB",
        "engine_args": ["--num-threads", "2"],
    }
    document = {"gateway": {"watch_config": False}, "models": [model]}
    process = ServeProcess(document, tmp_path_factory.mktemp("tool-loop"), free_port())
    try:
        process.wait_ready(1, timeout=180)
        yield process.url
    finally:
        process.stop()


@pytest.fixture
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=300)


def _check_call(call, name: str = "get_weather") -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS if name == "get_weather" else {"type": "object"})
    return arguments


def test_required_call_then_the_result_back_then_an_answer(client):
    # One call: SmolLM2 left free to make several repeats them until max_tokens.
    reply = client.chat.completions.create(
        **GREEDY,
        messages=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], choice.message.tool_calls[0].function.name)
    # The loop: the assistant's calls and one result per call, then an answer in text.
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}
        for call in choice.message.tool_calls
    ]
    messages = [*QUESTION, choice.message.model_dump(exclude_none=True), *results]
    final = client.chat.completions.create(
        **GREEDY, messages=messages, tools=[WEATHER, TIME], tool_choice="none"
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None and answer.message.content.strip()


def test_named_call_streamed_equals_not_streamed(client):
    kwargs = {**GREEDY, "messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": NAMED}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    arguments = _check_call(call)
    with client.chat.completions.stream(**kwargs) as events:
        streamed = events.get_final_completion().choices[0]
    (streamed_call,) = streamed.message.tool_calls
    assert streamed.finish_reason == "tool_calls"
    assert _check_call(streamed_call) == arguments  # greedy: the same call, accumulated by the SDK
    assert streamed_call.function.arguments == call.function.arguments
    assert streamed_call.id != call.id
