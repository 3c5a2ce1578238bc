"""Typed access to the fields of a JSON request body, shared by every parser: a field of the
wrong type, an integer beyond 64 bits or a number that is not finite is a 400 naming it."""

from __future__ import annotations

import math
from typing import Any

from common.errors import excerpt
from engine.errors import InvalidRequestError

_INT64 = 2**63  # integer fields hold 64-bit values, as in OpenAI's and vLLM's schemas
_MISSING = object()
_EXPECTED = {
    "int": "an integer",
    "number": "a number",
    "bool": "a boolean",
    "str": "a string",
    "dict": "an object",
    "list": "an array",
}
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}


def bad_field(param: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}' {problem}", param=param)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "int":
        return is_int(value)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"bool": bool, "str": str, "dict": dict, "list": list}[kind])


def get_field(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """Return body[name] checked against ``kind``; None and absent give ``default``. Integers
    must fit in 64 bits and numbers be finite (JSON parsers accept NaN, Infinity, 1e999)."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not _is_kind(value, kind):
        got = _JSON_TYPES.get(type(value), "object")
        raise bad_field(name, f"must be {_EXPECTED[kind]}, got {got}")
    if kind == "int" and not -_INT64 <= value < _INT64:
        raise bad_field(name, "must be a 64-bit integer")
    if kind == "number":
        return _finite(name, value)
    return value


def _finite(name: str, value: float) -> float:
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise bad_field(name, "must be a finite number")
    return number


def check_token_ids(ids: list[int], param: str, vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_field(
            param, f"holds token id {excerpt(str(bad))}, outside the vocabulary [0, {vocab_size})"
        )


def get_token_ids(body: dict, name: str, vocab_size: int) -> list[int]:
    """body[name] as a list of token ids below ``vocab_size``; absent or None give []."""
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise bad_field(name, "must be an array of integers")
    check_token_ids(value, name, vocab_size)
    return value
