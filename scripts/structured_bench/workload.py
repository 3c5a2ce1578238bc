"""The structured-outputs workload: one strict schema (nested object, array bounds, enums,
number bounds, optional fields), prompts asking for it, and how an output counts as valid."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

# Bounded so that a complete output fits the bench's 96 tokens in most cases: an output cut by
# max_tokens is incomplete, whatever the constraint.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist", "other"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}
# A valid instance, written as the grammar writes JSON (json.dumps separators).
INSTANCE = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "role": "engineer",
        "rating": 4,
        "skills": ["mathematics", "poetry"],
        "address": {"city": "London", "zip": "12345"},
    }
)
_SUBJECTS = [
    "a nurse from Lyon", "a retired pilot", "a young painter", "a chess teacher",
    "a software engineer in Osaka", "a baker", "a marine biologist", "a jazz drummer",
]  # fmt: skip
_FENCED = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def prompts(count: int) -> list[str]:
    schema = json.dumps(SCHEMA)
    return [
        f"Request {i}: describe {_SUBJECTS[i % len(_SUBJECTS)]} as a JSON object that follows "
        f"this JSON schema: {schema}. Reply with the JSON only."
        for i in range(count)
    ]


def is_valid(text: str) -> bool:
    """The whole output is one JSON document that validates against SCHEMA."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def is_valid_leniently(text: str) -> bool:
    """Valid once a Markdown code fence around the JSON (what chat models like to add) is
    removed: the most a client could recover from an unconstrained reply without guessing."""
    fenced = _FENCED.search(text)
    return is_valid(fenced.group(1).strip() if fenced else text.strip())
