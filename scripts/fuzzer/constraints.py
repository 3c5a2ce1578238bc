"""Structured-output constraints as data: what a request holds its output to (``Constraint``),
the request body that carries one, and builders of the pathological shapes issue 29 found (deep
``$ref`` chains, chained Lark rules, many ``patternProperties``, wide ``anyOf``, nested counted
repetitions). Used by the structured fuzz (structured_cases.py) and scripts/bench_attacks.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scripts.fuzzer.profile import CHAT

PROMPT = "Answer in the required format."
# The fields that may carry each kind of constraint; the first is the usual one.
CARRIERS: dict[str, tuple[str, ...]] = {
    "json_schema": ("response_format", "structured_outputs", "guided_json"),
    "json_object": ("response_format", "structured_outputs"),
    "regex": ("structured_outputs", "guided_regex"),
    "grammar": ("structured_outputs", "guided_grammar"),
    "choice": ("structured_outputs", "guided_choice"),
    "tools": ("tools",),
}
_STRUCTURED_KEYS = {
    "json_schema": "json",
    "json_object": "json_object",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
}


@dataclass(frozen=True)
class Constraint:
    """``kind`` (a CARRIERS key) and its ``value``: a schema (any JSON value: garbage too), the
    text of a regex or grammar, a list of choices, or a list of tools."""

    kind: str
    value: Any = None
    python_regex: bool = False  # regex: Python's re reads it as the engine's Rust regex does
    tool_choice: Any = "required"  # tools: "required" or {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # tools: sent when not None


def constrained_body(
    c: Constraint, model: str, path: str, max_tokens: int, carrier: str = "", **extra: Any
) -> dict[str, Any]:
    """A request on ``path`` (chat or completions) whose output ``c`` constrains, carried by
    ``carrier`` (default: the kind's usual field)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    carrier = carrier or CARRIERS[c.kind][0]
    if carrier == "response_format":
        body[carrier] = (
            {"type": "json_object"}
            if c.kind == "json_object"
            else {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": c.value}}
        )
    elif carrier == "structured_outputs":
        body[carrier] = {_STRUCTURED_KEYS[c.kind]: True if c.kind == "json_object" else c.value}
    elif carrier == "tools":
        body.update(tools=c.value, tool_choice=c.tool_choice)
        if c.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = c.parallel_tool_calls
    else:  # vLLM's older top-level guided_* names
        body[carrier] = c.value
    return body


def ref_chain(depth: int, style: str = "plain") -> dict[str, Any]:
    """A schema whose root reaches a string through ``depth`` ``$ref`` hops, each hop bare
    (``plain``), under a required property (``property``), in an ``allOf`` or an array."""

    def hop(target: str) -> dict[str, Any]:
        ref = {"$ref": f"#/$defs/{target}"}
        if style == "property":
            return {"type": "object", "properties": {"n": ref}, "required": ["n"]}
        if style == "allOf":
            return {"allOf": [ref]}
        if style == "array":
            return {"type": "array", "items": ref, "minItems": 1, "maxItems": 1}
        return ref

    defs = {f"d{i}": hop(f"d{i + 1}") for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string", "maxLength": 4}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def ref_chain_tools(depth: int) -> list[dict[str, Any]]:
    """One tool whose parameters reach a string through ``depth`` ``$ref`` hops."""
    chain = ref_chain(depth)
    parameters = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/d0"}},
        "required": ["a"],
        "$defs": chain["$defs"],
    }
    return [tool("f", parameters)]


def tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def lark_chain(rules: int, style: str = "plain") -> str:
    """A Lark grammar of ``rules`` rules, each one the next (``plain``), a literal before the
    next (``prefix``) or the next or a literal (``either``); the last one a literal."""
    body = {"plain": "r{n}", "prefix": '"a" r{n}', "either": 'r{n} | "x"'}[style]
    lines = [f"r{i}: " + body.format(n=i + 1) for i in range(rules)]
    return "start: r0\n" + "\n".join(lines) + f'\nr{rules}: "a"\n'


def pattern_properties(count: int, disjoint: bool = True) -> dict[str, Any]:
    """An object schema with ``count`` patternProperties; disjoint ones are checked pairwise
    (the slow compile of issue 29), overlapping ones are refused."""
    pattern = "^p{i}_[a-z]+$" if disjoint else "^[a-z]*{i}[0-9]*$"
    props = {pattern.format(i=i): {"type": "integer"} for i in range(count)}
    return {"type": "object", "patternProperties": props}


def anyof_objects(count: int, tag: str = "") -> dict[str, Any]:
    """``anyOf`` of ``count`` one-property object branches; ``tag`` makes a distinct variant."""
    branches = [
        {
            "type": "object",
            "properties": {f"k{tag}{i}": {"type": "integer"}},
            "required": [f"k{tag}{i}"],
            "additionalProperties": False,
        }
        for i in range(count)
    ]
    return {"anyOf": branches}


def counted_regex(inner: int, outer: int, suffix: str = "") -> str:
    """``(ab{inner}){outer}`` and a suffix: nested counted repetition, a tiny body for a huge
    automaton."""
    return f"(ab{{{inner}}}){{{outer}}}{suffix}"
