"""A request's prompt as token ids: chat messages through the model's template, then text through
the tokenizer. This is the costly part of a request (seconds for a long prompt): the server runs it
on the prompt thread, with that thread's own tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from common.errors import excerpt
from engine.errors import InvalidRequestError
from engine.serving.request_fields import bad_field
from engine.serving.tools.rendering import (
    check_tools_shown,
    fallback_messages,
    native_messages,
    template_renders_tools,
)

_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def _message_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_field(
                    f"messages[{index}].content",
                    f"part type {excerpt(repr(kind))} is not supported (only 'text' parts)",
                )
            if not isinstance(part.get("text"), str):
                raise bad_field(f"messages[{index}].content", "text part needs a string 'text'")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_field(f"messages[{index}].content", "must be a string or an array of text parts")


def _tool_calls(index: int, raw: Any) -> list[dict[str, Any]]:
    """An assistant message's earlier ``tool_calls``, as OpenAI sends them back."""
    path = f"messages[{index}].tool_calls"
    if not isinstance(raw, list) or not raw:
        raise bad_field(path, "must be a non-empty array of tool calls")
    calls = []
    for j, call in enumerate(raw):
        if not isinstance(call, dict):
            raise bad_field(f"{path}[{j}]", "must be an object")
        if call.get("type", "function") != "function":
            raise bad_field(f"{path}[{j}].type", "must be 'function'")
        function = call.get("function")
        if not isinstance(function, dict):
            raise bad_field(f"{path}[{j}].function", "must be an object")
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                raise bad_field(f"{path}[{j}].function.{key}", "must be a string")
        if not isinstance(call.get("id"), str):
            raise bad_field(f"{path}[{j}].id", "must be a string")
        calls.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return calls


def _message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_field(f"messages[{index}]", "must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise bad_field(
            f"messages[{index}].role",
            f"{excerpt(repr(role))} is not supported (system, developer, user, assistant, tool)",
        )
    parsed: dict[str, Any] = {"role": _ROLES[role]}
    if role == "assistant" and message.get("tool_calls") is not None:
        parsed["tool_calls"] = _tool_calls(index, message["tool_calls"])
        content = message.get("content")  # null beside calls, as OpenAI sends it back
        parsed["content"] = None if content is None else _message_text(index, content)
        return parsed
    if message.get("tool_calls") is not None:
        raise bad_field(f"messages[{index}].tool_calls", "only assistant messages make tool calls")
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise bad_field(f"messages[{index}].tool_call_id", "must be a string")
        parsed["tool_call_id"] = message["tool_call_id"]
    parsed["content"] = _message_text(index, message.get("content"))
    return parsed


def parse_messages(raw: Any) -> list[dict[str, Any]]:
    """A request's ``messages`` as the chat template takes them: ``content`` a string (None only
    beside an assistant's ``tool_calls``), a tool result's ``tool_call_id``."""
    if not isinstance(raw, list) or not raw:
        raise bad_field("messages", "must be a non-empty array of messages")
    return [_message(i, message) for i, message in enumerate(raw)]


def prompt_items(messages: list[dict[str, Any]]) -> int:
    """The pieces a chat template renders one by one: messages and earlier tool calls (each
    takes at least one token, its role or call markers, even with empty content)."""
    return len(messages) + sum(len(m.get("tool_calls", ())) for m in messages)


def prompt_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """The characters of a chat the template renders: the texts, earlier calls and tools."""
    chars = sum(len(m["content"] or "") for m in messages)
    for message in messages:
        for call in message.get("tool_calls", ()):
            chars += len(call["function"]["name"]) + len(call["function"]["arguments"])
    return chars + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0)


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    check_text: Callable[[str], None] = lambda text: None,
) -> list[int]:
    """Parsed ``messages`` (and OpenAI ``tools``) through the model's chat template, then
    tokenised (``check_text`` sees the template's output first: the prompt cap). A template that
    ignores tools gets them, and the conversation's earlier calls and results, in the Hermes
    format (engine/serving/tools/rendering.py)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; use /v1/completions")
    uses_tools = bool(tools) or any(m["role"] == "tool" or "tool_calls" in m for m in messages)
    section = None
    if uses_tools and template_renders_tools(tokenizer):
        messages = native_messages(messages)
    elif uses_tools:
        messages, section = fallback_messages(messages, tools)
        tools = None
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as error:  # jinja raises for conversations the template forbids
        raise InvalidRequestError(
            f"chat template error: {excerpt(str(error))}", param="messages"
        ) from error
    check_tools_shown(text, section)
    check_text(text)
    # The template already writes any BOS/special tokens it wants.
    return encode_text(tokenizer, text, "messages", add_special_tokens=False)


def encode_text(
    tokenizer: Any, text: str, param: str, add_special_tokens: bool = True
) -> list[int]:
    """``text``'s token ids; a tokenizer refusing it is a 400 naming ``param``."""
    try:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    except Exception as error:  # the tokenizer refusing some content: the client's text
        raise bad_field(param, f"cannot be tokenised: {excerpt(str(error))}") from error
