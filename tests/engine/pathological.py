"""Constraints that once crashed, stalled or bloated an engine (issue 29's findings), generated
here at the size that did it: a deep `$ref` chain, chained Lark rules, a tool whose parameters are
a `$ref` chain, hundreds of patternProperties, thousands of anyOf branches, a regex of nested
counted repetitions; and a schema within every static limit that still compiles for seconds."""

from __future__ import annotations

import json
from typing import Any


def ref_chain(depth: int) -> dict[str, Any]:
    """`#/$defs/d0` -> d1 -> ... -> a string: flat JSON, as deep as `depth` for the compiler."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(rules: int) -> str:
    lines = ["start: r0", *(f"r{i}: r{i + 1}" for i in range(rules)), f'r{rules}: "x"']
    return "\n".join(lines)


def pattern_properties(count: int) -> dict[str, Any]:
    patterns = {f"^p{i}[a-z]*$": {"type": "integer"} for i in range(count)}
    return {"type": "object", "patternProperties": patterns}


def object_branches(count: int, tag: str = "") -> dict[str, Any]:
    """anyOf of `count` one-key objects (`tag` makes a distinct variant)."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {f"k{tag}{i}": {"type": "integer"}},
                "required": [f"k{tag}{i}"],
                "additionalProperties": False,
            }
            for i in range(count)
        ]
    }


def nested_branches(width: int, tag: str = "") -> dict[str, Any]:
    """anyOf of `width` objects, each holding an anyOf of `width` objects (`tag` makes a
    distinct variant): within every static limit at 50 (about 215 KB), and seconds of
    compile."""
    inner = [
        {"type": "object", "properties": {f"b{j}": {"type": "integer"}}, "required": [f"b{j}"]}
        for j in range(width)
    ]
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {f"a{tag}{i}": {"anyOf": inner}},
                "required": [f"a{tag}{i}"],
            }
            for i in range(width)
        ]
    }


def repetition_bomb(tag: int) -> str:
    """141 bytes of regex whose first mask took 2.7 s and 177 MB (distinct per `tag`)."""
    return f"(ab{{1000}}){{1000}}c{tag}"


def tool_with(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "deep", "parameters": parameters}}


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema)
