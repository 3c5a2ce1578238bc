"""Tools in the prompt of a model whose chat template ignores them.

A template renders tools when rendering a conversation with a tool differs from rendering it
without (probed once per template text). One that does not gets the Hermes / Qwen2.5 format,
written by our own Jinja macros (``hermes_fallback.jinja``) into plain messages its template can
render: the tools listed as JSON inside ``<tools></tools>`` in the system message, the
assistant's earlier calls as ``<tool_call>`` blocks in its content, and tool results as a user
turn of ``<tool_response>`` blocks. A template that drops the system message this writes cannot
show the model its tools: that request is refused."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequestError

_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
_TOOL_AWARE: dict[str, bool] = {}  # chat template text -> whether it renders tools


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows the model its tools (asked once per template)."""
    template = tokenizer.chat_template
    if template not in _TOOL_AWARE:
        _TOOL_AWARE[template] = _probe(tokenizer)
    return _TOOL_AWARE[template]


def _probe(tokenizer: Any) -> bool:
    try:
        plain, with_tools = (
            tokenizer.apply_chat_template(
                _PROBE_MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False
            )
            for tools in (None, _PROBE_TOOLS)
        )
    except Exception:  # a template that refuses a plain user turn cannot take tools either
        return False
    return plain != with_tools


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a tool-aware template: calls' arguments as objects (transformers' and vLLM's
    convention; templates write them with ``tojson``), left a string when not a JSON object."""
    converted = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {**call, "function": {**call["function"], "arguments": _as_object(call)}}
                for call in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        converted.append(message)
    return converted


def _as_object(call: dict[str, Any]) -> Any:
    arguments = call["function"]["arguments"]
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, str]], str | None]:
    """Plain messages in the Hermes format, and the tools section they carry (None: no tools),
    which the rendered prompt must contain."""
    macros = _macros()
    plain: list[dict[str, str]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            if plain and plain[-1].get("tool"):  # one user turn for consecutive results
                plain[-1]["results"].append(content)
            else:
                plain.append({"role": "user", "tool": "yes", "results": [content]})
            continue
        if message.get("tool_calls"):
            calls = [_fallback_call(call) for call in message["tool_calls"]]
            content = str(macros.tool_calls(content, calls))
        plain.append({"role": role, "content": content})
    for message in plain:
        if message.pop("tool", None):
            message["content"] = str(macros.tool_responses(message.pop("results")))
    if not tools:
        return plain, None
    section = str(macros.tools_section(tools))
    if plain and plain[0]["role"] == "system":
        plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{section}"}
    else:
        plain.insert(0, {"role": "system", "content": section})
    return plain, section


def check_tools_shown(prompt: str, section: str | None) -> None:
    if section is not None and section not in prompt:
        raise InvalidRequestError(
            "tools are not supported by this model's chat template", param="tools"
        )


def _fallback_call(call: dict[str, Any]) -> dict[str, str]:
    """A call as the fallback writes it: its arguments verbatim when they are JSON, else as a
    JSON string (the block must stay JSON)."""
    arguments = call["function"]["arguments"]
    try:
        json.loads(arguments)
    except ValueError:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"name": call["function"]["name"], "arguments": arguments}


@cache
def _macros() -> Any:
    environment = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
    # Jinja's own tojson escapes <, > and & for HTML; a prompt wants the JSON as it is.
    environment.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    source = Path(__file__).with_name("hermes_fallback.jinja").read_text()
    return environment.from_string(source).module
