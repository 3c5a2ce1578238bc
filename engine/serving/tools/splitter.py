"""Generated text -> content and tool calls, as the text arrives: one splitter per choice.

- ``auto``: Hermes-format blocks, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  anywhere in the reply (``HermesSplitter``). Text outside the blocks is content; while the
  text might be opening a block, it is held back rather than sent as content. A block is sent
  as one call once it closes: a block that is not a valid call of a declared tool stays content.
- ``required`` / named: the reply is the constraint's JSON (``JsonCallSplitter``); each call's
  first piece carries its id and name, later pieces its arguments as they are generated.
- ``none``: no splitter; the reply is content.

A non-streamed reply runs the same splitter over the whole text (``split_reply``), so streamed and
non-streamed replies carry the same calls and content."""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, Protocol

from engine.serving.tools.json_scan import JsonCallScanner
from engine.serving.tools.request import ToolRequest

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_ID_ALPHABET = string.ascii_letters + string.digits
_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ContentPiece:
    text: str


@dataclass(frozen=True)
class CallPiece:
    """A piece of the choice's call number ``index``: the first carries ``id`` and ``name``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Piece = ContentPiece | CallPiece


class Splitter(Protocol):
    calls: int  # calls begun so far

    def feed(self, text: str) -> list[Piece]: ...
    def finish(self) -> list[Piece]: ...


def new_splitter(request: ToolRequest | None) -> Splitter | None:
    """The splitter for a choice of a request with these tools (None: no tool calls parsed)."""
    if request is None or request.mode == "none":
        return None
    if request.mode == "auto":
        return HermesSplitter(request.names)
    return JsonCallSplitter(request.mode == "required", request.names)


def split_reply(request: ToolRequest | None, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply's content (None when empty) and OpenAI ``tool_calls``."""
    splitter = new_splitter(request)
    if splitter is None:
        return text, []
    pieces = [*splitter.feed(text), *splitter.finish()]
    if isinstance(splitter, JsonCallSplitter) and not splitter.valid:
        return text or None, []  # cut short (max_tokens), or not constrained: the text as it is
    content = "".join(p.text for p in pieces if isinstance(p, ContentPiece))
    calls: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, CallPiece):
            if piece.id is not None:
                function = {"name": piece.name, "arguments": ""}
                calls.append({"id": piece.id, "type": "function", "function": function})
            calls[piece.index]["function"]["arguments"] += piece.arguments
    return content or None, calls


def _declared(name: Any, names: frozenset[str]) -> bool:
    return isinstance(name, str) and name in names  # a model may write any JSON as the name


# ---- auto: Hermes blocks -------------------------------------------------------------------


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and may grow into it)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesSplitter:
    """Content's whitespace is held back until more content follows it, so whitespace that
    only separates calls, or ends a reply that made calls, is no content; a reply without calls
    is its text exactly."""

    def __init__(self, names: frozenset[str]) -> None:
        self.calls = 0
        self._names = names
        self._buffer = ""  # outside a block: text held back; inside: the block so far
        self._inside = False
        self._pending_space = ""  # trailing whitespace of the content, held back

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            tag = CLOSE_TAG if self._inside else OPEN_TAG
            at = self._buffer.find(tag)
            if at < 0:
                break
            before, self._buffer = self._buffer[:at], self._buffer[at + len(tag) :]
            if self._inside:
                pieces += self._block(before, closed=True)
            else:
                pieces += self._content(before)
            self._inside = not self._inside
        if not self._inside:
            keep = _partial_tag(self._buffer, OPEN_TAG)
            ready = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(ready) :]
            pieces += self._content(ready)
        return pieces

    def finish(self) -> list[Piece]:
        """The end of the reply: an unclosed block is still a call if it parses, and any held
        text is content."""
        rest, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            pieces = self._block(rest, closed=False)
        else:
            pieces = self._content(rest)
        if not self.calls and self._pending_space:
            pieces.append(ContentPiece(self._pending_space))
        return pieces

    def _content(self, text: str) -> list[Piece]:
        held = self._pending_space + text
        body = held.rstrip(_WHITESPACE)
        self._pending_space = held[len(body) :]
        return [ContentPiece(body)] if body else []

    def _block(self, block: str, closed: bool) -> list[Piece]:
        call = self._parse(block)
        if call is None:  # not a call: it stays in the content, tags and all
            return self._content(OPEN_TAG + block + (CLOSE_TAG if closed else ""))
        name, arguments = call
        self.calls += 1
        return [CallPiece(self.calls - 1, arguments, new_call_id(), name)]

    def _parse(self, block: str) -> tuple[str, str] | None:
        try:
            call = json.loads(block)
        except ValueError:
            return None
        if not isinstance(call, dict) or not _declared(call.get("name"), self._names):
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)


# ---- required / named: the constraint's JSON ---------------------------------------------


class JsonCallSplitter:
    """Calls as the scanner finds them. Text that does not start the expected JSON (a model run
    without the constraint) is content. A call's arguments are sent only once its name is known,
    so with the name generated after them (the schema's key order) they come in one piece."""

    def __init__(self, array: bool, names: frozenset[str]) -> None:
        self.calls = 0
        self.valid = False  # set by finish: the whole reply is calls of declared tools
        self._array = array
        self._names = names
        self._scanner = JsonCallScanner(array)
        self._sent: list[int] = []  # argument characters sent, per call
        self._as_content = False

    def feed(self, text: str) -> list[Piece]:
        if self._as_content:
            return [ContentPiece(text)] if text else []
        self._scanner.feed(text)
        if self._scanner.failed and not self.calls:
            self._as_content = True
            return [ContentPiece(self._scanner.text)]
        return self._call_pieces()

    def finish(self) -> list[Piece]:
        self.valid = self._is_valid(self._scanner.text)
        if self._as_content:
            return []
        if not self.calls:
            text = self._scanner.text
            return [ContentPiece(text)] if text else []
        return self._call_pieces()

    def _call_pieces(self) -> list[Piece]:
        pieces: list[Piece] = []
        for index, call in enumerate(self._scanner.calls):
            if call.name is None:
                break  # calls are sent in order: this one's name first
            arguments = self._scanner.arguments(call)
            if index == self.calls:
                pieces.append(CallPiece(index, arguments, new_call_id(), call.name))
                self._sent.append(len(arguments))
                self.calls += 1
            elif len(arguments) > self._sent[index]:
                pieces.append(CallPiece(index, arguments[self._sent[index] :]))
                self._sent[index] = len(arguments)
        return pieces

    def _is_valid(self, text: str) -> bool:
        try:
            reply = json.loads(text)
        except ValueError:
            return False
        calls = reply if self._array else [reply]
        return (
            isinstance(calls, list)
            and bool(calls)
            and all(
                isinstance(call, dict)
                and _declared(call.get("name"), self._names)
                and "arguments" in call
                for call in calls
            )
        )
