"""Tool calls in a forced reply's JSON while it is still being generated.

A forced reply (tool_choice ``required`` or named, see ``constraint``) is an array of
``{"name": ..., "arguments": {...}}`` objects, or one such object. ``JsonCallScanner`` reads the
text as it grows, one character once, and records for each call its name (once its string is
complete) and where its arguments' JSON starts and ends, so a stream can send the arguments as
they are generated without ever re-parsing the whole text. It checks only the outer shape; the
values inside the arguments are the constraint's job (and ``json.loads`` checks a whole reply)."""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\r\n"


@dataclass
class ScannedCall:
    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None  # exclusive; None while the arguments are still growing


class JsonCallScanner:
    """Scans an array of calls (``array``) or a single call object."""

    def __init__(self, array: bool) -> None:
        self.text = ""
        self.calls: list[ScannedCall] = []
        self.failed = False  # the text is not the start of the expected shape
        self.closed = False  # the outer value is complete
        self._array = array
        self._member_depth = 2 if array else 1  # nesting depth of a call object's members
        self._stack: list[str] = []  # open brackets
        self._pos = 0
        self._in_string = False
        self._escape = False
        self._string_start = 0
        # At a call's member level: key, key_string, colon, value, value_string, primitive,
        # comma (after a value).
        self._expect = "key"
        self._key: str | None = None
        self._value_start = 0

    def feed(self, text: str) -> None:
        self.text += text
        while self._pos < len(self.text) and not (self.failed or self.closed):
            self._step(self.text[self._pos])
            self._pos += 1

    def arguments(self, call: ScannedCall) -> str:
        """The call's arguments text so far (trailing whitespace held back until it is known to
        be inside the value); a prefix of every later answer."""
        if call.arguments_start is None:
            return ""
        if call.arguments_end is not None:
            return self.text[call.arguments_start : call.arguments_end]
        return self.text[call.arguments_start :].rstrip(_WHITESPACE)

    # ---- the state machine -----------------------------------------------------------------

    def _step(self, char: str) -> None:
        if self._in_string:
            self._string_char(char)
        elif len(self._stack) > self._member_depth:
            self._nested_char(char)
        elif len(self._stack) == self._member_depth:
            self._member_char(char)
        elif char in _WHITESPACE:
            pass
        elif not self._stack:  # before the outer value
            self._open_outer(char)
        else:  # between the calls of the array
            self._between_calls(char)

    def _string_char(self, char: str) -> None:
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            if len(self._stack) == self._member_depth:
                self._member_string_done()

    def _start_string(self) -> None:
        self._in_string = True
        self._string_start = self._pos

    def _open_outer(self, char: str) -> None:
        if char != ("[" if self._array else "{"):
            self.failed = True
            return
        self._stack.append(char)
        if not self._array:
            self._open_call()

    def _between_calls(self, char: str) -> None:
        if char == "{":
            self._stack.append(char)
            self._open_call()
        elif char == "]":
            self._stack.pop()
            self.closed = True
        elif char != ",":
            self.failed = True

    def _open_call(self) -> None:
        self.calls.append(ScannedCall())
        self._expect = "key"

    def _close_call(self) -> None:
        self._stack.pop()
        if not self._array:
            self.closed = True

    def _member_char(self, char: str) -> None:
        expect = self._expect
        if expect == "primitive":
            if char in ",}":
                self._value_done(len(self.text[: self._pos].rstrip(_WHITESPACE)))
                self._after_value(char)
        elif char in _WHITESPACE:
            pass
        elif expect == "key":
            if char == '"':
                self._expect = "key_string"
                self._start_string()
            elif char == "}":
                self._close_call()
            else:
                self.failed = True
        elif expect == "colon":
            if char == ":":
                self._expect = "value"
            else:
                self.failed = True
        elif expect == "value":
            self._value_start = self._pos
            if self._key == "arguments":
                self.calls[-1].arguments_start = self._pos
            if char == '"':
                self._expect = "value_string"
                self._start_string()
            elif char in "{[":
                self._stack.append(char)
            else:
                self._expect = "primitive"
        else:  # comma
            self._after_value(char)

    def _after_value(self, char: str) -> None:
        if char == ",":
            self._expect = "key"
        elif char == "}":
            self._close_call()
        else:
            self.failed = True

    def _nested_char(self, char: str) -> None:
        if char == '"':
            self._start_string()
        elif char in "{[":
            self._stack.append(char)
        elif char in "}]":
            self._stack.pop()
            if len(self._stack) == self._member_depth:
                self._value_done(self._pos + 1)
                self._expect = "comma"

    def _member_string_done(self) -> None:
        literal = self.text[self._string_start : self._pos + 1]
        if self._expect == "key_string":
            try:
                self._key = json.loads(literal)
            except ValueError:
                self.failed = True
            self._expect = "colon"
        else:
            self._value_done(self._pos + 1)
            self._expect = "comma"

    def _value_done(self, end: int) -> None:
        call = self.calls[-1]
        if self._key == "arguments":
            call.arguments_end = end
        elif self._key == "name":
            try:
                name = json.loads(self.text[self._value_start : end])
            except ValueError:
                name = None
            call.name = name if isinstance(name, str) else None
