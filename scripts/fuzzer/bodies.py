"""Valid request bodies per path: what every family starts from before it breaks something."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from typing import Any

from scripts.fuzzer.profile import CHAT, COMPLETIONS, DETOKENIZE, TOKENIZE, Profile

# Optional fields with values both servers accept (the engine honours or ignores them all).
_VALID_COMMON: dict[str, list[Any]] = {
    "temperature": [0, 0.7, 2],
    "top_p": [0.9, 1],
    "top_k": [-1, 0, 5],
    "min_p": [0.0, 0.1],
    "seed": [0, 1, 2**32],
    "stop": [".", ["\n", "!"]],
    "stop_token_ids": [[3], []],
    "presence_penalty": [0.5, -2],
    "frequency_penalty": [0.5, 2],
    "repetition_penalty": [1.1, 0.9],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}, {"include_usage": False}],
    "user": ["fuzz-user"],
    "ignore_eos": [True, False],
    "response_format": [{"type": "text"}],
    "n": [1, 2],
}
_VALID_CHAT: dict[str, list[Any]] = {
    **_VALID_COMMON,
    "max_completion_tokens": [1, 2],
    "logprobs": [False],
    "add_generation_prompt": [True, False],
}
_VALID_COMPLETION: dict[str, list[Any]] = {
    **_VALID_COMMON,
    "logprobs": [0, 2],
    "echo": [False],
    "suffix": [""],
}


def _valid_chat(rng: random.Random, p: Profile) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": p.model,
        "messages": [{"role": rng.choice(["user", "system"]), "content": "Hello there"}],
        "max_tokens": rng.randint(1, p.max_tokens),
    }
    if rng.random() < 0.3:
        body["messages"].append({"role": "assistant", "content": "Hi"})
        body["messages"].append({"role": "user", "content": [{"type": "text", "text": "Go"}]})
    return _with_optional(rng, body, _VALID_CHAT)


def _valid_completion(rng: random.Random, p: Profile) -> dict[str, Any]:
    prompt = rng.choice(["Hello there", [5, 6, 7], ["Hello"], [[5, 6, 7]]])
    body = {"model": p.model, "prompt": prompt, "max_tokens": rng.randint(1, p.max_tokens)}
    return _with_optional(rng, body, _VALID_COMPLETION)


def _with_optional(
    rng: random.Random, body: dict[str, Any], fields: dict[str, list[Any]]
) -> dict[str, Any]:
    for name in rng.sample(sorted(fields), rng.randint(0, 4)):
        body[name] = copy.deepcopy(rng.choice(fields[name]))
    if body.get("n", 1) > 1 and "best_of" not in body and "prompt" in body:
        body["best_of"] = body["n"]
    return body


def _valid_tokenize(rng: random.Random, p: Profile) -> dict[str, Any]:
    if rng.random() < 0.5:
        return {"model": p.model, "prompt": "Hello there", "add_special_tokens": True}
    return {"model": p.model, "messages": [{"role": "user", "content": "Hi"}]}


def _valid_detokenize(rng: random.Random, p: Profile) -> dict[str, Any]:
    return {"model": p.model, "tokens": [5, 6, 7]}


# path -> valid body maker
BODIES: dict[str, Callable[[random.Random, Profile], dict[str, Any]]] = {
    CHAT: _valid_chat,
    COMPLETIONS: _valid_completion,
    TOKENIZE: _valid_tokenize,
    DETOKENIZE: _valid_detokenize,
}


def body_paths(p: Profile) -> list[str]:
    return [CHAT, COMPLETIONS, *p.tokenizer_paths]


def valid_bytes(rng: random.Random, p: Profile, path: str) -> bytes:
    return json.dumps(BODIES[path](rng, p), ensure_ascii=False).encode()
