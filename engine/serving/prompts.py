"""A request's prompt as token ids: chat messages through the model's template, then text through
the tokenizer. This is the costly part of a request (seconds for a long prompt): the server runs it
on the prompt thread, with that thread's own tokenizer."""

from __future__ import annotations

from typing import Any

from common.errors import excerpt
from engine.errors import InvalidRequestError
from engine.serving.request_fields import bad_field

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """A request's ``messages`` as the chat template takes them."""
    if not isinstance(raw, list) or not raw:
        raise bad_field("messages", "must be a non-empty array of messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise bad_field(f"messages[{i}]", "must be an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_field(
                f"messages[{i}].role",
                f"{excerpt(repr(role))} is not supported (system, developer, user, assistant)",
            )
        if message.get("tool_calls"):
            raise bad_field(f"messages[{i}].tool_calls", "tool calls are not supported")
        messages.append({"role": _ROLES[role], "content": _message_text(i, message.get("content"))})
    return messages


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> list[int]:
    """Parsed ``messages`` through the model's chat template, then tokenised."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as error:  # jinja raises for conversations the template forbids
        raise InvalidRequestError(
            f"chat template error: {excerpt(str(error))}", param="messages"
        ) from error
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
