"""Family ``field``: a valid body with one to three fields, at any depth, set to an edge value or
removed."""

from __future__ import annotations

import copy
import itertools
import random
from typing import Any

from scripts.fuzzer.bodies import BODIES, body_paths
from scripts.fuzzer.profile import CHAT, COMPLETIONS, DETOKENIZE, TOKENIZE, Profile
from scripts.fuzzer.request import Case, post
from scripts.fuzzer.values import EDGE_VALUES, model_values, to_json

Path = tuple[str | int, ...]
# A field path, and what its parent must first be so the path exists (None: the body has it).
Target = tuple[Path, tuple[Path, Any] | None]

_PART = [{"type": "text", "text": "Hello"}]
_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
_COMMON_FIELDS = [
    "model", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "stream",
    "stream_options", "user", "response_format", "logit_bias", "logprobs", "ignore_eos",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "allowed_token_ids",
    "bad_words", "priority", "request_id", "length_penalty", "use_beam_search",
    "prompt_logprobs", "structured_outputs", "metadata", "service_tier", "store",
]  # fmt: skip
_CHAT_FIELDS = [
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "documents", "modalities", "audio", "prediction",
    "reasoning_effort", "web_search_options", "functions", "function_call",
]  # fmt: skip
_COMPLETION_FIELDS = ["prompt", "echo", "best_of", "suffix", "add_special_tokens"]


def _top(names: list[str]) -> list[Target]:
    return [((name,), None) for name in names]


_SHARED_NESTED: list[Target] = [
    (("stream_options", "include_usage"), (("stream_options",), {"include_usage": True})),
    (("stream_options", "continuous_usage_stats"), (("stream_options",), {})),
    (("response_format", "type"), (("response_format",), {"type": "json_object"})),
    (("response_format", "json_schema"), (("response_format",), {"type": "json_schema"})),
    (("logit_bias", "5"), (("logit_bias",), {"5": 1})),
]
_TARGETS: dict[str, list[Target]] = {
    CHAT: _top(_COMMON_FIELDS + _CHAT_FIELDS)
    + _SHARED_NESTED
    + [
        (("messages", 0), None),
        (("messages", 1), None),
        (("messages", 0, "role"), None),
        (("messages", 0, "content"), None),
        (("messages", 0, "name"), None),
        (("messages", 0, "tool_calls"), None),
        (("messages", 0, "tool_call_id"), None),
        (("messages", 0, "refusal"), None),
        (("messages", 0, "content", 0), (("messages", 0, "content"), _PART)),
        (("messages", 0, "content", 0, "type"), (("messages", 0, "content"), _PART)),
        (("messages", 0, "content", 0, "text"), (("messages", 0, "content"), _PART)),
        (("messages", 0, "content", 0, "image_url"), (("messages", 0, "content"), _PART)),
        (("tools", 0), (("tools",), _TOOL)),
        (("tools", 0, "function", "name"), (("tools",), _TOOL)),
        (("tools", 0, "function", "parameters"), (("tools",), _TOOL)),
    ],
    COMPLETIONS: _top(_COMMON_FIELDS + _COMPLETION_FIELDS)
    + _SHARED_NESTED
    + [
        (("prompt", 0), (("prompt",), ["Hello", "there"])),
        (("prompt", 0, 0), (("prompt",), [[5, 6, 7]])),
        (("prompt", 1), (("prompt",), [5, 6, 7])),
    ],
    TOKENIZE: [
        *_top(["model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"]),
        (("messages", 0, "role"), (("messages",), [{"role": "user", "content": "Hi"}])),
        (("messages", 0, "content"), (("messages",), [{"role": "user", "content": "Hi"}])),
    ],
    DETOKENIZE: [*_top(["model", "tokens"]), (("tokens", 0), None), (("tokens", 1), None)],
}


# Fields OpenAI or vLLM accept that neither server here reads (the gateway passes them on, the
# engine ignores them): fuzzed less often than the ones that reach parsing code.
_UNREAD_FIELDS = frozenset(
    ["min_tokens", "skip_special_tokens", "truncate_prompt_tokens", "guided_json",
     "guided_regex", "guided_choice", "guided_grammar", "allowed_token_ids", "bad_words",
     "priority", "request_id", "length_penalty", "use_beam_search", "prompt_logprobs",
     "structured_outputs", "metadata", "service_tier", "store", "tool_choice",
     "parallel_tool_calls", "continue_final_message", "chat_template", "chat_template_kwargs",
     "documents", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
     "functions", "function_call"]
)  # fmt: skip
_READ_TARGETS = {
    path: [t for t in targets if t[0][0] not in _UNREAD_FIELDS]
    for path, targets in _TARGETS.items()
}


def _path_label(path: Path) -> str:
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else key)
    return text


def _put(root: dict[str, Any], path: Path, value: Any) -> None:
    """Sets root[path] = value, creating objects on the way; an int past a list's end appends."""
    node: Any = root
    for key, child in itertools.pairwise(path):
        want = list if isinstance(child, int) else dict
        current = _get(node, key)
        if not isinstance(current, want):
            current = want()
            _assign(node, key, current)
        node = current
    _assign(node, path[-1], value)


def _get(node: Any, key: str | int) -> Any:
    if isinstance(node, list):
        return node[key] if isinstance(key, int) and key < len(node) else None
    return node.get(key)


def _assign(node: Any, key: str | int, value: Any) -> None:
    if isinstance(node, list) and isinstance(key, int) and key >= len(node):
        node.append(value)
    else:
        node[key] = value


def _remove(root: dict[str, Any], path: Path) -> None:
    node: Any = root
    for key in path[:-1]:
        node = _get(node, key)
        if not isinstance(node, (dict, list)):
            return
    last = path[-1]
    if isinstance(node, dict):
        node.pop(last, None)
    elif isinstance(last, int) and last < len(node):
        del node[last]


def field_case(rng: random.Random, p: Profile) -> Case:
    path = rng.choice(body_paths(p))
    body = BODIES[path](rng, p)
    labels = []
    unavailable = False
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        targets = _READ_TARGETS[path] if rng.random() < 0.75 else _TARGETS[path]
        target, setup = rng.choice(targets)
        if setup is not None:
            _put(body, setup[0], copy.deepcopy(setup[1]))
        if rng.random() < 0.08:
            _remove(body, target)
            labels.append(f"{_path_label(target)} removed")
            continue
        pool = model_values(p) + EDGE_VALUES if target == ("model",) else EDGE_VALUES
        name, make = rng.choice(pool)
        _put(body, target, make(p))
        unavailable = unavailable or name == "model unavailable"
        labels.append(f"{_path_label(target)} <- {name}")
    data = to_json(body, ascii_only=rng.random() < 0.7)
    return post(p, path, data, label="field " + "; ".join(labels), unavailable_ok=unavailable)
