"""Structured outputs on the real SmolLM2-135M-Instruct: chat requests asking for JSON, constrained
by schemas of every shape the subset supports, all parse and validate; regex and choice hold."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine.core.llm import LLM
from engine.core.sampling_params import SamplingParams, StructuredOutput
from tests.engine.test_structured_decoding import SCHEMAS

pytestmark = [pytest.mark.smollm2, pytest.mark.timeout(600)]

PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "job": {"enum": ["engineer", "doctor", "teacher", "other"]},
                },
                "required": ["name", "age", "job"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
ALL_SCHEMAS = {**SCHEMAS, "people": PEOPLE}


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    return LLM(str(smollm2_gguf), num_threads=2, max_model_len=1024)


def ask(llm: LLM, questions: list[str], params: SamplingParams) -> list[str]:
    chats = [[{"role": "user", "content": question}] for question in questions]
    return [result.outputs[0].text for result in llm.chat(chats, params)]


def chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_every_schema_validates(llm) -> None:
    """Two prompts per schema, all in one batch (each request with its own schema)."""
    core = llm.engine
    texts: dict[str, str] = {}
    for name, schema in ALL_SCHEMAS.items():
        params = SamplingParams(
            temperature=0.7,
            seed=1,
            max_tokens=200,
            structured=StructuredOutput("json_schema", json.dumps(schema)),
        )
        questions = [
            f"Reply with JSON following this schema: {json.dumps(schema)}",
            "Describe a person you admire, as JSON.",
        ]
        for i, question in enumerate(questions):
            core.add_request(f"{name}/{i}", chat_ids(llm, question), params)
            texts[f"{name}/{i}"] = ""
    for _ in range(1000):
        for out in core.step():
            texts[out.request_id] += out.outputs[0].text
        if not core.has_unfinished():
            break
    for request_id, text in texts.items():
        jsonschema.validate(json.loads(text), ALL_SCHEMAS[request_id.split("/")[0]])


def test_regex_and_choice(llm) -> None:
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    regex = SamplingParams(
        temperature=0.0, max_tokens=20, structured=StructuredOutput("regex", date)
    )
    (text,) = ask(llm, ["When did the first moon landing happen? Give a date."], regex)
    assert re.fullmatch(date, text)
    choices = ["positive", "negative", "neutral"]
    choice = SamplingParams(
        temperature=0.0, max_tokens=10, structured=StructuredOutput("choice", json.dumps(choices))
    )
    answers = ask(llm, ["I love this film!", "This is the worst day ever."], choice)
    assert all(answer in choices for answer in answers)
