"""Whether a 200 answer's output keeps to its constraint, judged by validators independent of the
engine's grammar library: jsonschema for schemas and tool arguments, Python's re for regexes whose
syntax it reads the same way (the ``regex`` package's partial matching for outputs cut by
``max_tokens``, less a character those cut in two), the list itself for choices. Lark and GBNF
grammars are not judged.

Verdicts: ``valid``, ``broken`` (a finding), ``incomplete`` (cut by ``max_tokens`` and not
provably off course) and ``unchecked`` (nothing here can judge it). An output counts as complete
unless its finish reason is ``length``: ``stop`` and ``tool_calls`` mean the grammar was done, and
any other reason (``abort``) must not leave an output that breaks it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import regex

from scripts.fuzzer.constraints import Constraint

NO_ARGUMENTS = {"type": "object", "maxProperties": 0}  # a tool declared without parameters


@dataclass(frozen=True)
class Output:
    text: str | None
    tool_calls: list[Any] | None
    finish_reason: str | None


def outputs(reply: bytes) -> list[Output] | None:
    """The choices of a chat or text completion body; None when it is not one."""
    try:
        choices = json.loads(reply)["choices"]
        found = []
        for choice in choices:
            message = choice.get("message")
            text = message.get("content") if message is not None else choice["text"]
            calls = message.get("tool_calls") if message is not None else None
            found.append(Output(text, calls, choice.get("finish_reason")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return found


def _not_json(literal: str) -> Any:
    raise ValueError(f"{literal} is not JSON")


def _strict_json(text: str) -> Any:
    """JSON as RFC 8259 has it: Python's NaN and Infinity literals refused."""
    return json.loads(text, parse_constant=_not_json)


def check(c: Constraint, out: Output) -> tuple[str, str]:
    """(verdict, detail) of one output against its constraint; the detail names the finish
    reason."""
    verdict, detail = _judge(c, out)
    return verdict, f"{out.finish_reason}: {detail}" if detail else ""


def _judge(c: Constraint, out: Output) -> tuple[str, str]:
    cut = out.finish_reason == "length"
    if c.kind == "tools":
        return ("incomplete", "") if cut else _tool_calls(c, out)
    text = out.text if out.text is not None else ""
    if cut:  # max_tokens may cut a character's bytes: the engine ends them as U+FFFD
        text = text.removesuffix("\ufffd")
    if c.kind == "choice":
        return _choice(c.value, text, cut)
    if c.kind == "regex":
        return _regex(c, text, cut)
    if c.kind == "grammar":
        return "unchecked", "grammars are not judged"
    if cut:
        return "incomplete", ""
    try:
        instance = _strict_json(text)
    except ValueError:
        return "broken", f"not JSON: {text[:80]!r}"
    if c.kind == "json_object":
        return ("valid", "") if isinstance(instance, dict) else ("broken", "not an object")
    schema = c.value
    if isinstance(schema, str):  # structured_outputs.json as JSON text
        try:
            schema = json.loads(schema)
        except ValueError:
            return "unchecked", "schema text is not JSON"
    return _schema(schema, instance)


def _schema(schema: Any, instance: Any) -> tuple[str, str]:
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(cls(schema).iter_errors(instance))
    except Exception as exc:  # the validator's own limits (recursion, odd refs): not a verdict
        return "unchecked", f"validator: {type(exc).__name__}"
    if error is None:
        return "valid", ""
    return "broken", f"{error.message[:120]} at {error.json_path}"


def _choice(choices: Any, text: str, cut: bool) -> tuple[str, str]:
    if not isinstance(choices, list):
        return "unchecked", "choices not a list"
    strings = [s for s in choices if isinstance(s, str)]
    if cut:
        ok = any(s.startswith(text) for s in strings)
        return ("incomplete", "") if ok else ("broken", f"no choice starts {text[:80]!r}")
    return ("valid", "") if text in strings else ("broken", f"not a choice: {text[:80]!r}")


def _regex(c: Constraint, text: str, cut: bool) -> tuple[str, str]:
    if not c.python_regex:
        return "unchecked", "regex syntax not Python's"
    try:
        if cut:
            ok = regex.fullmatch(c.value, text, partial=True) is not None
            return ("incomplete", "") if ok else ("broken", f"no match can start {text[:80]!r}")
        matched = re.fullmatch(c.value, text) is not None
    except (re.error, regex.error, RecursionError) as exc:
        return "unchecked", f"Python cannot compile it: {exc}"[:120]
    return ("valid", "") if matched else ("broken", f"does not match: {text[:80]!r}")


def _tool_calls(c: Constraint, out: Output) -> tuple[str, str]:
    try:
        declared = {t["function"]["name"]: t["function"] for t in c.value}
    except (TypeError, KeyError):
        return "unchecked", "tools not as declared"
    if isinstance(c.tool_choice, dict):
        named = c.tool_choice.get("function", {}).get("name")
        declared = {named: declared[named]} if named in declared else {}
    calls = out.tool_calls or []
    if not calls:
        return "broken", f"no tool call: {str(out.text)[:80]!r}"
    if c.parallel_tool_calls is False and len(calls) > 1:
        return "broken", f"{len(calls)} calls with parallel_tool_calls false"
    for call in calls:
        function = call.get("function", {})
        name = function.get("name")
        if name not in declared:
            return "broken", f"call of {name!r}, not a declared tool"
        try:
            arguments = _strict_json(function.get("arguments", ""))
        except ValueError:
            return "broken", f"arguments not JSON: {str(function.get('arguments'))[:80]!r}"
        verdict = _schema(declared[name].get("parameters", NO_ARGUMENTS), arguments)
        if verdict[0] != "valid":
            return verdict
    return "valid", ""
