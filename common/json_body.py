"""Request bodies as strict JSON: UTF-8 only (RFC 8259), no lone surrogates, bounded nesting.

Python's ``json`` accepts what later code cannot handle: ``"\\ud800"`` (and, from bytes, UTF-8
encoded surrogates) becomes a ``str`` that fails to encode again in the tokenizer or when the
gateway re-encodes a body; 1,000 levels of ``[`` raise RecursionError. Each is a 400 here, before
anything else sees the body. The checks that walk the parsed value run only when a cheap scan of
the bytes says they might find something, so ordinary bodies pay two C-speed scans.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from common.errors import RequestRefused

MAX_DEPTH = 128  # far deeper than any request (JSON schemas included) needs
OFF_LOOP_BYTES = 64 * 1024  # larger bodies are parsed off the event loop
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _invalid(message: str) -> RequestRefused:
    return RequestRefused(400, message, "invalid_json")


async def parse_json_body(body: bytes) -> Any:
    """``parse_json``, on a worker thread for a body over ``OFF_LOOP_BYTES``: megabytes of small
    objects take a few hundred milliseconds to parse and check, which on the event loop would
    stall every other request (120,000 empty chat messages from two senders once pushed other
    clients to p50 10 s). The GIL still serialises the work, but the loop gets its turns."""
    if len(body) <= OFF_LOOP_BYTES:
        return parse_json(body)
    return await asyncio.to_thread(parse_json, body)


def parse_json(body: bytes) -> Any:
    """The parsed body; RequestRefused 400 ``invalid_json`` for anything but strict JSON."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"Request body is not valid UTF-8 (byte {exc.start}).") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _invalid(f"Request body nests JSON deeper than {MAX_DEPTH} levels.") from None
    except ValueError as exc:
        raise _invalid(f"Request body is not valid JSON: {exc}") from None
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH:
        _check_depth(value)
    if _SURROGATE_ESCAPE.search(body):
        _check_strings(value)
    return value


def _check_depth(value: Any) -> None:
    """Walks the containers without recursion (strings and numbers are never pushed)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _invalid(f"Request body nests JSON deeper than {MAX_DEPTH} levels.")
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))


def _check_strings(value: Any) -> None:
    """Strings (keys too) that hold a surrogate code point, which only an unpaired
    ``\\uD800``-``\\uDFFF`` escape can produce (the depth is known to be bounded by then)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_string(item)
        elif isinstance(item, dict):
            for key in item:
                _check_string(key)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _check_string(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid(
            "Request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair); "
            "strings must be valid Unicode."
        ) from None
