"""Seeded HTTP fuzz cases for both servers (tests/test_fuzz.py, scripts/fuzz.py).

Case ``index`` of seed ``seed`` is a pure function of (profile, seed, index): its own
``random.Random`` is seeded from those three, so any case is rebuilt alone from the numbers a
report gives (``make_case(profile, seed, index)``), without generating the ones before it.

Three families, mixed by weight:

- ``field``: a valid /v1/chat/completions or /v1/completions body (engine: also /tokenize and
  /detokenize) with one to three fields, at any depth, replaced by a value of another JSON type or
  an edge value (huge numbers, NaN, lone surrogate escapes, NUL, RTL, huge strings...), or removed.
- ``json``: the bytes of a valid body broken: truncated, trailing garbage, BOM, NaN literals,
  duplicate keys, nesting 100 / 1,000 / 100,000 deep, other top-level types, non-UTF-8, UTF-16/32.
- ``http``: compressed bodies (valid, invalid, truncated, bombs), Content-Length and chunked
  framing errors, Expect, Content-Type, Authorization and other headers of odd bytes and shapes,
  wrong methods, unknown paths, odd request lines and non-HTTP bytes; the engine's /tokenize and
  /detokenize, the gateway's /admin/* and /v1/models.

Every case stays under a few MB, so thousands run in seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gzip
import itertools
import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
BODY_LIMIT = 4 * 2**20  # both servers' default max_body_bytes
_BOMB_BYTES = 32 * 2**20  # what a zip bomb inflates to: 8x the body limit, from ~32 KB


@dataclass(frozen=True)
class Profile:
    """What the generator knows about the server it writes for."""

    name: str  # "gateway" | "engine": part of every case's seed
    model: str  # a served model name
    aliases: tuple[str, ...] = ()  # other valid names for it
    unavailable_model: str | None = None  # gateway: a model whose only upstream is down
    api_key: str | None = None  # gateway: a valid client key (sent unless the case fuzzes it)
    admin_key: str | None = None
    admin_paths: tuple[str, ...] = ()
    tokenizer_paths: tuple[str, ...] = ()  # engine: /tokenize, /detokenize
    get_paths: tuple[str, ...] = ("/v1/models", "/health", "/ready", "/metrics")
    max_string: int = 2**20  # the "huge string" edge value; the engine tokenizes it
    max_tokens: int = 4  # valid bodies ask for at most this many tokens
    vocab: int = 100  # token ids below this are valid


def gateway_profile(api_key: str, admin_key: str) -> Profile:
    """Matches tests/test_fuzz.py's and scripts/fuzz.py's gateway: model m1 (alias default) on
    the mock upstream, model ``down`` on a port nothing listens on."""
    return Profile(
        name="gateway",
        model="m1",
        aliases=("default",),
        unavailable_model="down",
        api_key=api_key,
        admin_key=admin_key,
        admin_paths=(
            "/admin/backends",
            "/admin/reload",
            "/admin/drain",
            "/admin/prometheus/targets",
        ),
    )


def engine_profile(model: str = "tiny") -> Profile:
    # 64 KB "huge" strings: the tokenizer's time grows with them and most other cases take ms.
    return Profile(
        name="engine", model=model, tokenizer_paths=(TOKENIZE, DETOKENIZE), max_string=2**16
    )


@dataclass(frozen=True)
class Case:
    """One request: ``raw`` bytes when given (sent as they are), else the request built from
    method, path, headers and body (headers complete: nothing is added when sending)."""

    label: str  # what is fuzzed; findings are grouped by it
    method: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes = b""
    raw: bytes | None = None
    # The request is unfinished on purpose (declared body or head not all sent): the server may
    # wait for the rest, so no answer is right; an answer (408, 400, 413) must still be JSON.
    incomplete: bool = False
    # Not HTTP at all (TLS, HTTP/2 preface, binary noise, HTTP/0.9): closing without an answer
    # is right, as no HTTP/1.x answer can be understood; an answer must still be JSON.
    may_close: bool = False
    # Gateway: routed to the model whose upstream is down, so 502/503/504 are the right answers.
    unavailable_ok: bool = False
    seed: int = 0
    index: int = 0

    def wire(self) -> bytes:
        if self.raw is not None:
            return self.raw
        head = [f"{self.method} {self.path} HTTP/1.1".encode("latin-1")]
        head += [name + b": " + value for name, value in self.headers]
        return b"\r\n".join(head) + b"\r\n\r\n" + self.body

    def excerpt(self, limit: int = 240) -> str:
        """The request as a report shows it: bytes escaped, long runs cut."""
        data = self.wire()
        text = repr(data[:limit])
        return text + (f" ...(+{len(data) - limit} bytes)" if len(data) > limit else "")


@dataclass(frozen=True)
class Raw:
    """JSON text written into a body as it is: what json.dumps cannot produce (lone surrogate
    escapes, -0.0, 1e999, bytes that are not UTF-8)."""

    text: bytes


# ---- JSON values and bodies ----------------------------------------------------------------


def to_json(value: Any, ascii_only: bool) -> bytes:
    """JSON bytes of ``value`` with its Raw parts verbatim; NaN and infinities as the non-standard
    literals json.dumps writes."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        items = (
            to_json(str(k), ascii_only) + b":" + to_json(v, ascii_only) for k, v in value.items()
        )
        return b"{" + b",".join(items) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(to_json(v, ascii_only) for v in value) + b"]"
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8")


def _nested(depth: int, opener: bytes = b"[", closer: bytes = b"]", inner: bytes = b"1") -> Raw:
    return Raw(opener * depth + inner + closer * depth)


# (label, factory): the values a fuzzed field takes. Factories, so that huge values are built
# only when drawn; the label names the value in reports.
Edge = tuple[str, Callable[[Profile], Any]]

_EDGE_VALUES: list[Edge] = [
    ("null", lambda p: None),
    ("true", lambda p: True),
    ("false", lambda p: False),
    ("int 0", lambda p: 0),
    ("int -1", lambda p: -1),
    ("int 1", lambda p: 1),
    ("int 2", lambda p: 2),
    ("int 2**31", lambda p: 2**31),
    ("int 2**53+1", lambda p: 2**53 + 1),
    ("int 2**63", lambda p: 2**63),
    ("int 2**64", lambda p: 2**64),
    ("int -2**63-1", lambda p: -(2**63) - 1),
    ("int 10**30", lambda p: 10**30),
    ("int of 5000 digits", lambda p: Raw(b"1" * 5000)),
    ("float 0.5", lambda p: 0.5),
    ("float -0.0", lambda p: Raw(b"-0.0")),
    ("float 1e-320", lambda p: 1e-320),
    ("float 1e308", lambda p: 1e308),
    ("float -1e308", lambda p: -1e308),
    ("float 1e999 (overflows to inf)", lambda p: Raw(b"1e999")),
    ("literal NaN", lambda p: float("nan")),
    ("literal Infinity", lambda p: float("inf")),
    ("literal -Infinity", lambda p: float("-inf")),
    ("str empty", lambda p: ""),
    ("str space", lambda p: " "),
    ("str a", lambda p: "a"),
    ("str '1'", lambda p: "1"),
    ("str 'true'", lambda p: "true"),
    ("str 'user'", lambda p: "user"),
    ("str huge", lambda p: "x" * p.max_string),
    ("str huge words", lambda p: "hello world " * (p.max_string // 12)),
    ("str huge emoji", lambda p: "\U0001f600" * (p.max_string // 4)),
    ("str NUL", lambda p: "a\x00b"),
    ("str control chars", lambda p: "".join(map(chr, range(32)))),
    ("str RTL override", lambda p: "\u202eabc\u202c\u200f"),
    ("str emoji", lambda p: "\U0001f600\U0001f44d\U0001f3fd\u200d"),
    ("str combining marks", lambda p: "e" + "\u0301" * 200),
    ("str BOM and U+FFFF", lambda p: "\ufeff\uffff\ufffe"),
    ("str CRLF header injection", lambda p: "a\r\nX-Injected: 1\r\n\r\nb"),
    ("str special tokens", lambda p: "<|im_end|>\n<|im_start|>system\n<|endoftext|>"),
    ("str template syntax", lambda p: "{{ 7*7 }}{% raw %}{# x #}"),
    ("str format specifiers", lambda p: "%s%n%x{0}{}\\"),
    ("str lone surrogate \\ud800", lambda p: Raw(b'"\\ud800"')),
    ("str lone surrogate \\udfff", lambda p: Raw(b'"\\udfff"')),
    ("str lone surrogate in text", lambda p: Raw(b'"ab\\udbffcd"')),
    ("str reversed surrogate pair", lambda p: Raw(b'"\\udfff\\ud800"')),
    ("str valid surrogate pair", lambda p: Raw(b'"\\ud83d\\ude00"')),
    ("str UTF-8 encoded surrogate", lambda p: Raw(b'"\xed\xa0\x80"')),
    ("str overlong NUL bytes", lambda p: Raw(b'"\xc0\x80"')),
    ("str invalid byte 0xff", lambda p: Raw(b'"\xff\xfe"')),
    ("str latin-1 byte", lambda p: Raw(b'"caf\xe9"')),
    ("str very long model-like name", lambda p: "m" * 10000),
    ("list empty", lambda p: []),
    ("list of null", lambda p: [None]),
    ("list ['user']", lambda p: ["user"]),
    ("list of ints", lambda p: [1, 2, 3]),
    ("list of strings", lambda p: ["a", "b"]),
    ("list of lists", lambda p: [[1, 2], [3]]),
    ("list of empty lists", lambda p: [[]]),
    ("list of objects", lambda p: [{}]),
    ("list mixed types", lambda p: [1, "a", None, True, 1.5, [], {}]),
    ("list nested 64", lambda p: _nested(64)),
    ("list of 100k ints", lambda p: Raw(b"[" + b",".join([b"7"] * 100_000) + b"]")),
    ("list of 5k strings", lambda p: Raw(b"[" + b",".join([b'"s"'] * 5000) + b"]")),
    ("object empty", lambda p: {}),
    ("object empty key", lambda p: {"": None}),
    ("object text part", lambda p: {"type": "text", "text": "hi"}),
    ("object message", lambda p: {"role": "user", "content": "hi"}),
    ("object __proto__", lambda p: {"__proto__": {"polluted": 1}, "constructor": None}),
    (
        "object 10k keys",
        lambda p: Raw(b"{%s}" % b",".join(b'"k%d":%d' % (i, i) for i in range(10_000))),
    ),
    ("object nested 64", lambda p: _nested(64, b'{"a":', b"}")),
]

# Values only some fields get, because they mean something there.
_MODEL_VALUES: list[Edge] = [
    ("model alias", lambda p: p.aliases[0] if p.aliases else p.model),
    ("model unknown", lambda p: "no-such-model"),
    ("model other case", lambda p: p.model.upper()),
    ("model padded", lambda p: f" {p.model} "),
    ("model unavailable", lambda p: p.unavailable_model or p.model),
]


def _model_values(p: Profile) -> list[Edge]:
    return [v for v in _MODEL_VALUES if p.unavailable_model or v[0] != "model unavailable"]


# ---- valid bodies ----------------------------------------------------------------------------

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
_BODIES: dict[str, Callable[[random.Random, Profile], dict[str, Any]]] = {
    CHAT: _valid_chat,
    COMPLETIONS: _valid_completion,
    TOKENIZE: _valid_tokenize,
    DETOKENIZE: _valid_detokenize,
}


def _body_paths(p: Profile) -> list[str]:
    return [CHAT, COMPLETIONS, *p.tokenizer_paths]


# ---- fields to fuzz --------------------------------------------------------------------------

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


# ---- family: field mutations ---------------------------------------------------------------


def _field_case(rng: random.Random, p: Profile) -> Case:
    path = rng.choice(_body_paths(p))
    body = _BODIES[path](rng, p)
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
        pool = _model_values(p) + _EDGE_VALUES if target == ("model",) else _EDGE_VALUES
        name, make = rng.choice(pool)
        _put(body, target, make(p))
        unavailable = unavailable or name == "model unavailable"
        labels.append(f"{_path_label(target)} <- {name}")
    data = to_json(body, ascii_only=rng.random() < 0.7)
    return _post(p, path, data, label="field " + "; ".join(labels), unavailable_ok=unavailable)


# ---- family: broken JSON -------------------------------------------------------------------


def _valid_bytes(rng: random.Random, p: Profile, path: str) -> bytes:
    return json.dumps(_BODIES[path](rng, p), ensure_ascii=False).encode()


def _json_truncated(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return b[: rng.randrange(len(b))]


def _json_trailing(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return b + rng.choice([b"}", b"]", b",", b"x", b"\x00", b' {"a":1}', b"\n\n{", b"\xff", b"//"])


def _json_bom(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return rng.choice([b"\xef\xbb\xbf", b"\xfe\xff", b"\xff\xfe"]) + b


def _json_nan_literal(rng: random.Random, p: Profile, b: bytes) -> bytes:
    literal = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"undefined"])
    return b[:-1] + b',"temperature":' + literal + b"}"


def _json_duplicate_keys(rng: random.Random, p: Profile, b: bytes) -> bytes:
    # A key the body has: the copy differs in value, and which copy wins decides the request.
    key = json.dumps(rng.choice(sorted(json.loads(b)))).encode()
    value = rng.choice([b"null", b"1", b'"x"', b"[]", b"{}", b"true"])
    if rng.random() < 0.5:
        return b"{" + key + b":" + value + b"," + b[1:]  # the valid value comes last
    return b[:-1] + b"," + key + b":" + value + b"}"  # the odd one comes last


def _json_many_duplicates(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return b"{" + b'"model":"x",' * 50_000 + b[1:]


def _json_deep(rng: random.Random, p: Profile, b: bytes) -> bytes:
    depth = rng.choice([100, 129, 1000, 100_000])
    where = rng.choice(["top", "field", "object", "unclosed"])
    if where == "top":
        return _nested(depth).text
    if where == "object":
        return _nested(depth, b'{"a":', b"}").text
    if where == "unclosed":
        return b[:-1] + b',"messages":' + b"[" * depth
    field = rng.choice([b'"messages"', b'"prompt"', b'"stop"', b'"tools"', b'"metadata"'])
    return b[:-1] + b"," + field + b":" + _nested(depth).text + b"}"


def _json_top_level(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return rng.choice(
        [b"[]", b"[" + b + b"]", b'"hello"', b"123", b"null", b"true", b"1e999", b'""']
    )


def _json_non_utf8(rng: random.Random, p: Profile, b: bytes) -> bytes:
    bad = rng.choice(
        [b"\xff", b"\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc3"]
    )
    at = b.find(b"Hello")
    at = at + 2 if at >= 0 else rng.randrange(1, len(b))
    return b[:at] + bad + b[at:]


def _json_latin1(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return b.replace(b"Hello", "Héllo wörld".encode("latin-1"))


def _json_wide(rng: random.Random, p: Profile, b: bytes) -> bytes:
    coding = rng.choice(["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
    return b.decode().encode(coding)


def _json_not_json(rng: random.Random, p: Profile, b: bytes) -> bytes:
    return rng.choice(
        [
            b"",
            b"   \n\t ",
            b"{'model': 'x'}",
            b'{model: "x"}',
            b[:-1] + b",}",
            b'{"a": 1 /* comment */}',
            b'{"messages": [1,]}',
            b'{"content": "a\tb\nc"}',
            b'{"a": "\\x41"}',
            b'{"a": "\\u12"}',
            b'{"a": "\\uZZZZ"}',
            b'{"a": "\\',
            b'{"a": 01}',
            b'{"a": .5}',
            b'{"a": +1}',
            b'{"a": 0x10}',
            b'{"a": 1e}',
            b'{"a": -}',
            b"\x00" * 64,
            b"model=m1&prompt=hi",
        ]
    )


_JSON_BREAKERS: list[tuple[str, Callable[[random.Random, Profile, bytes], bytes]]] = [
    ("truncated", _json_truncated),
    ("trailing garbage", _json_trailing),
    ("byte order mark", _json_bom),
    ("NaN/Infinity literal", _json_nan_literal),
    ("duplicate keys", _json_duplicate_keys),
    ("50k duplicate keys", _json_many_duplicates),
    ("deep nesting", _json_deep),
    ("top-level not an object", _json_top_level),
    ("non-UTF-8 bytes", _json_non_utf8),
    ("latin-1 body", _json_latin1),
    ("UTF-16/32 body", _json_wide),
    ("not JSON", _json_not_json),
]


def _json_case(rng: random.Random, p: Profile) -> Case:
    path = rng.choice(_body_paths(p))
    name, breaker = rng.choice(_JSON_BREAKERS)
    body = breaker(rng, p, _valid_bytes(rng, p, path))
    label = f"json {name}"
    if name == "deep nesting":
        label += f" ({body.count(b'[') + body.count(b'{')} brackets)"
    return _post(p, path, body, label=label)


# ---- requests --------------------------------------------------------------------------------


def _auth(p: Profile, path: str) -> list[tuple[bytes, bytes]]:
    key = p.admin_key if path.startswith("/admin") else p.api_key
    return [(b"Authorization", b"Bearer " + key.encode())] if key else []


def _headers(p: Profile, path: str, body: bytes) -> list[tuple[bytes, bytes]]:
    """A well-formed request's headers, the valid key included; cases then change them."""
    return [
        (b"Host", b"127.0.0.1"),
        (b"Content-Type", b"application/json"),
        *_auth(p, path),
        (b"Content-Length", str(len(body)).encode()),
    ]


def _post(p: Profile, path: str, body: bytes, label: str, **flags: Any) -> Case:
    return Case(label, "POST", path, tuple(_headers(p, path, body)), body, **flags)


def _replace_header(
    headers: list[tuple[bytes, bytes]], name: bytes, values: list[bytes]
) -> tuple[tuple[bytes, bytes], ...]:
    kept = [(n, v) for n, v in headers if n.lower() != name.lower()]
    return tuple(kept + [(name, v) for v in values])


def _completion_request(rng: random.Random, p: Profile) -> tuple[str, bytes]:
    path = rng.choice([CHAT, COMPLETIONS])
    return path, _valid_bytes(rng, p, path)


# ---- family: HTTP level --------------------------------------------------------------------


@functools.cache
def _bomb(coding: str, model: str) -> bytes:
    """A body that inflates to _BOMB_BYTES: a valid request whose content is that many spaces."""
    text = b'{"model":"' + model.encode() + b'","prompt":"' + b" " * _BOMB_BYTES + b'"}'
    return _compress(coding, text, level=9)


def _compress(coding: str, data: bytes, level: int = 6) -> bytes:
    if coding == "gzip":
        return gzip.compress(data, compresslevel=level, mtime=0)
    if coding == "deflate":
        return zlib.compress(data, level)
    raw = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
    return raw.compress(data) + raw.flush()


def _encoded(rng: random.Random, p: Profile) -> Case:
    path, plain = _completion_request(rng, p)
    coding = rng.choice(["gzip", "deflate", "raw deflate"])
    header = b"deflate" if coding == "raw deflate" else coding.encode()
    packed = _compress(coding, plain)
    variants: dict[str, Callable[[], bytes]] = {
        "valid": lambda: packed,
        "invalid": lambda: rng.randbytes(rng.randint(1, 200)),
        "truncated": lambda: packed[: rng.randrange(1, len(packed))],
        "trailing garbage": lambda: packed + b"garbage",
        "two members": lambda: packed + packed,
        "plain body": lambda: plain,
        "empty": lambda: b"",
        "bomb": lambda: _bomb(coding, p.model),
        "compressed twice": lambda: _compress(coding, packed),
    }
    variant = rng.choice(sorted(variants))
    body = variants[variant]()
    headers = _replace_header(_headers(p, path, body), b"Content-Encoding", [header])
    return Case(f"http Content-Encoding {coding}: {variant}", "POST", path, headers, body)


def _odd_encoding(rng: random.Random, p: Profile) -> Case:
    path, plain = _completion_request(rng, p)
    value = rng.choice(
        [b"br", b"zstd", b"compress", b"unknown", b"gzip, deflate", b"identity", b"", b"GZIP",
         b"x-gzip", b"gzip;q=1", b"\xff\xfe", b"chunked"]
    )  # fmt: skip
    body = _compress("gzip", plain) if value.lower() in (b"gzip", b"x-gzip") else plain
    headers = _replace_header(_headers(p, path, body), b"Content-Encoding", [value])
    return Case(f"http Content-Encoding {value!r}", "POST", path, headers, body)


def _content_length(rng: random.Random, p: Profile) -> Case:
    path, body = _completion_request(rng, p)
    n = len(body)
    variants: dict[str, tuple[list[bytes], bool]] = {
        "smaller than body": ([str(n // 2).encode()], False),
        "larger than body": ([str(n + 100).encode()], True),
        "zero": ([b"0"], False),
        "negative": ([b"-1"], False),
        "plus sign": ([b"+" + str(n).encode()], False),
        "hex": ([hex(n).encode()], False),
        "not a number": ([b"abc"], False),
        "empty": ([b""], False),
        "spaces around": ([b"  " + str(n).encode() + b"  "], False),
        "list": ([str(n).encode() + b", " + str(n).encode()], False),
        "twice, equal": ([str(n).encode(), str(n).encode()], False),
        "twice, different": ([str(n).encode(), str(n + 1).encode()], False),
        "20 digits": ([b"9" * 20], True),
        "over the body limit": ([str(BODY_LIMIT * 4).encode()], True),
        "leading zeros": ([b"000" + str(n).encode()], False),
    }
    variant = rng.choice(sorted(variants))
    values, incomplete = variants[variant]
    headers = _replace_header(_headers(p, path, body), b"Content-Length", values)
    return Case(
        f"http Content-Length {variant}", "POST", path, headers, body, incomplete=incomplete
    )


def _chunks(rng: random.Random, body: bytes) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(body)), min(3, len(body) - 1)))
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]


def _chunked(rng: random.Random, p: Profile) -> Case:
    path, body = _completion_request(rng, p)
    parts = _chunks(rng, body)
    framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in parts)
    variants: dict[str, tuple[bytes, bool]] = {
        "valid": (framed + b"0\r\n\r\n", False),
        "with trailers": (framed + b"0\r\nX-Trailer: 1\r\n\r\n", False),
        "with extensions": (framed.replace(b"\r\n", b";ext=1\r\n", 1) + b"0\r\n\r\n", False),
        "bad size": (b"zz\r\n" + body + b"\r\n0\r\n\r\n", False),
        "negative size": (b"-5\r\n" + body + b"\r\n0\r\n\r\n", False),
        "size 0x prefix": (b"0x10\r\n" + body[:16] + b"\r\n0\r\n\r\n", False),
        "size overflows 64 bits": (b"f" * 20 + b"\r\n" + body + b"\r\n0\r\n\r\n", False),
        "size larger than data": (b"%x\r\n" % (len(body) + 50) + body + b"\r\n0\r\n\r\n", True),
        "size smaller than data": (b"%x\r\n" % (len(body) // 2) + body + b"\r\n0\r\n\r\n", False),
        "no final chunk": (framed, True),
        "missing CRLF after data": (b"%x\r\n" % len(body) + body + b"0\r\n\r\n", False),
        "bare LF": (framed.replace(b"\r\n", b"\n") + b"0\n\n", False),
        "non-ASCII extension": (b"%x;\xff\xfe\r\n" % len(body) + body + b"\r\n0\r\n\r\n", False),
        "over the body limit": (b"%x\r\n" % (BODY_LIMIT + 1) + b" " * (BODY_LIMIT + 1), True),
    }
    variant = rng.choice(sorted(variants))
    data, incomplete = variants[variant]
    te = rng.choice([b"chunked"] * 4 + [b"CHUNKED", b"gzip, chunked", b"chunked, identity"])
    headers = [h for h in _headers(p, path, body) if h[0] != b"Content-Length"]
    if rng.random() < 0.15:  # both framings: a request smuggling classic
        headers.append((b"Content-Length", str(len(body)).encode()))
    headers.append((b"Transfer-Encoding", te))
    label = f"http chunked {variant}"
    return Case(label, "POST", path, tuple(headers), data, incomplete=incomplete)


def _odd_transfer_encoding(rng: random.Random, p: Profile) -> Case:
    path, body = _completion_request(rng, p)
    value = rng.choice([b"identity", b"xchunked", b"chunked ", b"gzip", b"", b"\xffchunked"])
    headers = _replace_header(_headers(p, path, body), b"Transfer-Encoding", [value])
    return Case(f"http Transfer-Encoding {value!r}", "POST", path, headers, body)


def _expect(rng: random.Random, p: Profile) -> Case:
    path, body = _completion_request(rng, p)
    value = rng.choice(
        [b"100-continue", b"100-Continue", b"200-ok", b"", b"100-continue, foo", b"\xff"]
    )
    headers = [*_headers(p, path, body), (b"Expect", value)]
    label = f"http Expect {value!r}"
    if rng.random() < 0.3:  # a declared body over the limit, not sent: 413 before 100 Continue
        headers = list(_replace_header(headers, b"Content-Length", [str(BODY_LIMIT * 2).encode()]))
        return Case(
            label + " with a body over the limit",
            "POST",
            path,
            tuple(headers),
            b"",
            incomplete=True,
        )
    return Case(label, "POST", path, tuple(headers), body)


def _content_type(rng: random.Random, p: Profile) -> Case:
    path, body = _completion_request(rng, p)
    value = rng.choice(
        [None, b"text/plain", b"application/x-www-form-urlencoded",
         b"multipart/form-data; boundary=x", b"application/json; charset=utf-16",
         b"application/json; charset=latin-1", b"\xff\xfe/\x00",
         b"application/json" + b"; x=y" * 1000, b"*/*", b"application/json, text/plain"]
    )  # fmt: skip
    headers = list(_headers(p, path, body))
    headers = [h for h in headers if h[0] != b"Content-Type"]
    if value is not None:
        headers.append((b"Content-Type", value))
    return Case(f"http Content-Type {value!r:.60}", "POST", path, tuple(headers), body)


_AUTH_VALUES: list[tuple[str, bytes | None]] = [
    ("missing", None),
    ("Bearer only", b"Bearer"),
    ("Bearer and spaces", b"Bearer    "),
    ("Basic", b"Basic Zm9vOmJhcg=="),
    ("wrong key", b"Bearer not-the-key"),
    ("lowercase scheme", b"bearer {key}"),
    ("valid key padded", b"Bearer   {key}   "),
    ("latin-1 byte", b"Bearer caf\xe9"),
    ("non-UTF-8 bytes", b"Bearer \xff\xfe\xfd"),
    ("UTF-8 Cyrillic", "Bearer ключ".encode()),
    ("control chars", b"Bearer a\x01b\x7f"),
    ("4000 bytes", b"Bearer " + b"k" * 4000),
    ("9000 bytes", b"Bearer " + b"k" * 9000),
    ("key with tab", b"Bearer\t{key}"),
]


def _authorization(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([CHAT, COMPLETIONS, "/v1/models", *p.admin_paths])
    body = _valid_bytes(rng, p, path) if path in (CHAT, COMPLETIONS) else b""
    name, value = rng.choice(_AUTH_VALUES)
    key = (p.admin_key if path.startswith("/admin") else p.api_key) or "k"
    headers = [h for h in _headers(p, path, body) if h[0] != b"Authorization"]
    if value is not None:
        headers.append((b"Authorization", value.replace(b"{key}", key.encode())))
    if rng.random() < 0.15:  # and a valid one as well: which of the two counts?
        headers += _auth(p, path)
        name += " plus a valid one"
    method = (
        "GET" if path in ("/v1/models", "/admin/backends", "/admin/prometheus/targets") else "POST"
    )
    if path.startswith("/admin") and method == "POST":
        body = b'{"drain": false}'  # a valid admin key must never drain the fleet under test
        headers = list(_replace_header(headers, b"Content-Length", [str(len(body)).encode()]))
    return Case(f"http Authorization {name} on {path}", method, path, tuple(headers), body)


def _odd_header(rng: random.Random, p: Profile) -> Case:
    path, body = _completion_request(rng, p)
    variants: dict[str, list[tuple[bytes, bytes]]] = {
        "x-request-id non-UTF-8": [(b"X-Request-Id", b"\xff\xfe\x80")],
        "x-request-id 8000 bytes": [(b"X-Request-Id", b"r" * 8000)],
        "x-request-id UTF-8 emoji": [(b"X-Request-Id", "\U0001f600".encode())],
        "x-request-id control chars": [(b"X-Request-Id", b"a\x01\x02b")],
        "header value 9000 bytes": [(b"X-Big", b"v" * 9000)],
        "200 headers": [(b"X-H%d" % i, b"v") for i in range(200)],
        "non-ASCII header name": [("X-Ключ".encode(), b"v")],
        "header name with space": [(b"X Bad", b"v")],
        "empty header name": [(b"", b"v")],
        "Host twice": [(b"Host", b"evil.example")],
        "Host garbage": [(b"Host", b"\xff\x00:99999")],
        "Connection close": [(b"Connection", b"close")],
        "Upgrade h2c": [(b"Connection", b"Upgrade, HTTP2-Settings"), (b"Upgrade", b"h2c")],
        "Upgrade websocket": [(b"Connection", b"Upgrade"), (b"Upgrade", b"websocket")],
        "Accept-Encoding gzip": [(b"Accept-Encoding", b"gzip, br")],
        "Accept event-stream": [(b"Accept", b"text/event-stream")],
        "Range": [(b"Range", b"bytes=0-1")],
        "Cookie 4000 bytes": [(b"Cookie", b"a=" + b"c" * 4000)],
        "latin-1 header value": [(b"X-Name", b"Ren\xe9e")],
        "NUL in header value": [(b"X-Nul", b"a\x00b")],
        "Forwarded spoof": [(b"X-Forwarded-For", b"1.2.3.4, \xff"), (b"Forwarded", b'for="[::1]"')],
    }
    variant = rng.choice(sorted(variants))
    headers = list(_headers(p, path, body)) + variants[variant]
    return Case(f"http header {variant}", "POST", path, tuple(headers), body)


def _malformed_head(rng: random.Random, p: Profile) -> Case:
    """Heads no Case header list can express: written out byte by byte."""
    path, body = _completion_request(rng, p)
    auth = b"".join(n + b": " + v + b"\r\n" for n, v in _auth(p, path))
    length = b"Content-Length: %d\r\n" % len(body)
    start = b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
    variants: dict[str, tuple[bytes, bool]] = {
        "header without colon": (
            start + b"NoColonHere\r\n" + auth + length + b"\r\n" + body,
            False,
        ),
        "obs-fold continuation": (
            start + b"X-A: 1\r\n  folded\r\n" + auth + length + b"\r\n" + body,
            False,
        ),
        "bare LF line ends": (
            (start + auth + length).replace(b"\r\n", b"\n") + b"\n" + body,
            False,
        ),
        "bare CR in header": (start + b"X-A: 1\r2\r\n" + auth + length + b"\r\n" + body, False),
        "space before colon": (start + b"Content-Length : 2\r\n" + auth + b"\r\n{}", False),
        "no Host": (
            b"POST " + path.encode() + b" HTTP/1.1\r\n" + auth + length + b"\r\n" + body,
            False,
        ),
        "unterminated head": (start + auth + length, True),
        "head cut mid-line": (start + b"X-Cut: abc", True),
        "pipelined garbage": (
            start + auth + length + b"\r\n" + body + b"\x16\x03\x01garbage\r\n\r\n",
            False,
        ),
        "two requests pipelined": ((start + auth + length + b"\r\n" + body) * 2, False),
    }
    variant = rng.choice(sorted(variants))
    raw, incomplete = variants[variant]
    return Case(f"http head {variant}", "POST", path, (), raw=raw, incomplete=incomplete)


def _request_line(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([CHAT, COMPLETIONS, "/v1/models"])
    auth = b"".join(n + b": " + v + b"\r\n" for n, v in _auth(p, path))
    tail = b"\r\nHost: x\r\n" + auth + b"Content-Length: 0\r\n\r\n"
    target = path.encode()
    variants: dict[str, tuple[bytes, bool]] = {
        "HTTP/1.0": (b"GET " + target + b" HTTP/1.0" + tail, False),
        "HTTP/2.0": (b"GET " + target + b" HTTP/2.0" + tail, False),
        "HTTP/1.2": (b"GET " + target + b" HTTP/1.2" + tail, False),
        "HTTP/9.9": (b"GET " + target + b" HTTP/9.9" + tail, False),
        "lowercase version": (b"GET " + target + b" http/1.1" + tail, False),
        "version junk": (b"GET " + target + b" HTTP/1.1x" + tail, False),
        "extra field": (b"GET " + target + b" HTTP/1.1 extra" + tail, False),
        "HTTP/0.9": (b"GET " + target + b"\r\n", True),
        "version HTTP/0.9": (b"GET " + target + b" HTTP/0.9" + tail, False),
        "absolute URI": (b"GET http://127.0.0.1" + target + b" HTTP/1.1" + tail, False),
        "asterisk target": (b"OPTIONS * HTTP/1.1" + tail, False),
        "non-ASCII target": (b"GET /v1/\xff\xfe HTTP/1.1" + tail, False),
        "space in target": (b"GET /v1/ch at HTTP/1.1" + tail, False),
        "9000-byte target": (b"GET /" + b"a" * 9000 + b" HTTP/1.1" + tail, False),
        "lowercase method": (b"post " + target + b" HTTP/1.1" + tail, False),
        "non-ASCII method": (b"P\xffST " + target + b" HTTP/1.1" + tail, False),
        "1000-byte method": (b"X" * 1000 + b" " + target + b" HTTP/1.1" + tail, False),
        "CONNECT": (b"CONNECT 127.0.0.1:443 HTTP/1.1" + tail, False),
        "tab separators": (b"GET\t" + target + b"\tHTTP/1.1" + tail, False),
        "leading empty lines": (b"\r\n\r\nGET " + target + b" HTTP/1.1" + tail, False),
    }
    variant = rng.choice(sorted(variants))
    raw, incomplete = variants[variant]
    may_close = variant == "HTTP/0.9"
    return Case(
        f"http request line {variant}",
        "GET",
        path,
        (),
        raw=raw,
        incomplete=incomplete,
        may_close=may_close,
    )


def _garbage(rng: random.Random, p: Profile) -> Case:
    variants: dict[str, bytes] = {
        "random bytes": rng.randbytes(rng.randint(1, 512)),
        "TLS ClientHello": bytes.fromhex("160301002a0100002603035f") + rng.randbytes(40),
        "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00",
        "SSH banner": b"SSH-2.0-OpenSSH_9.6\r\n",
        "NUL bytes": b"\x00" * 256,
        "only CRLFs": b"\r\n" * 64,
    }
    variant = rng.choice(sorted(variants))
    # A server may wait for a request to start after blank lines, or close on noise.
    return Case(
        f"http not HTTP: {variant}", "GET", "/", (), raw=variants[variant], may_close=True,
        incomplete=variant == "only CRLFs",
    )  # fmt: skip


def _method(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([CHAT, COMPLETIONS, *p.tokenizer_paths, *p.get_paths, *p.admin_paths])
    method = rng.choice(
        ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "HEAD", "FOO", "POST"]
    )
    body = _valid_bytes(rng, p, path) if path in _BODIES and rng.random() < 0.5 else b""
    if path in ("/admin/drain", "/admin/reload"):
        body = b'{"drain": false}'  # never drain or reload the fleet under test
    headers = _headers(p, path, body)
    if path == "/admin/reload":
        headers = list(_replace_header(headers, b"Authorization", [b"Bearer wrong"]))
    return Case(f"http method {method} {path}", method, path, tuple(headers), body)


_UNKNOWN_PATHS = [
    "/", "/v2/chat/completions", "/v1/chat/completions/", "//v1/chat/completions",
    "/v1/chat/completions?stream=true&x=%ff", "/v1/chat%2Fcompletions", "/%ff%fe",
    "/v1/models/../models", "/v1/models/m1", "/v1/embeddings", "/v1/responses",
    "/v1/chat/completions;x=1", "/admin", "/admin/", "/metrics?name[]=x", "/.env",
    "/v1/models?limit=-1", "/health/../ready", "/v1/completions%00", "/" + "a/" * 2000,
]  # fmt: skip


def _unknown_path(rng: random.Random, p: Profile) -> Case:
    path = rng.choice(_UNKNOWN_PATHS)
    method = rng.choice(["GET", "POST"])
    body = _valid_bytes(rng, p, CHAT) if method == "POST" else b""
    return Case(f"http path {path[:40]}", method, path, tuple(_headers(p, path, body)), body)


def _get_endpoint(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([*p.get_paths, *p.admin_paths])
    if path in ("/admin/drain", "/admin/reload"):
        return _admin_post(rng, p, path)
    query = rng.choice(["", "?external=true", "?x=%ff%fe", "?" + "a=1&" * 500, "?external=\x00"])
    body = rng.choice([b"", b"", b"{}", b"\xff"])
    target = path + query.replace("\x00", "%00")
    return Case(f"http GET {path}", "GET", target, tuple(_headers(p, path, body)), body)


def _admin_post(rng: random.Random, p: Profile, path: str) -> Case:
    """The mutating admin endpoints get the valid admin key only with bodies that leave the fleet
    as it is (no reload, no drain); the rest of the time a wrong key and any body."""
    name, make = rng.choice(_EDGE_VALUES)
    if path == "/admin/drain" and rng.random() < 0.6:
        field = rng.choice(["backend", "model"])
        body = to_json({"backend": "127.0.0.1:1", "drain": False, field: make(p)}, True)
        label = f"http POST /admin/drain (admin key) {field} <- {name}"
        return _post(p, path, body, label=label)
    body = to_json({"drain": make(p)}, True)
    headers = _replace_header(_headers(p, path, body), b"Authorization", [b"Bearer wrong"])
    return Case(f"http POST {path} (wrong key) drain <- {name}", "POST", path, headers, body)


def _body_over_limit(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([CHAT, COMPLETIONS])
    content = "x" * (BODY_LIMIT + rng.choice([1, 1000]))
    body = json.dumps(
        {"model": p.model, "prompt": content, "messages": [{"role": "user", "content": "a"}]}
    )
    return _post(p, path, body.encode(), label="http body over the limit")


def _unavailable(rng: random.Random, p: Profile) -> Case:
    """A valid request for the gateway's model whose upstream is down (the engine: a valid one)."""
    path = rng.choice([CHAT, COMPLETIONS])
    body = _BODIES[path](rng, p)
    body["model"] = p.unavailable_model or p.model
    data = json.dumps(body).encode()
    return _post(
        p,
        path,
        data,
        label=f"http valid request for model {body['model']}",
        unavailable_ok=bool(p.unavailable_model),
    )


_HTTP_FAMILY: list[tuple[Callable[[random.Random, Profile], Case], int]] = [
    (_encoded, 6),
    (_odd_encoding, 2),
    (_content_length, 3),
    (_chunked, 3),
    (_odd_transfer_encoding, 1),
    (_expect, 2),
    (_content_type, 2),
    (_authorization, 3),
    (_odd_header, 3),
    (_malformed_head, 2),
    (_request_line, 2),
    (_garbage, 1),
    (_method, 2),
    (_unknown_path, 2),
    (_get_endpoint, 2),
    (_body_over_limit, 1),
    (_unavailable, 1),
]


def _http_case(rng: random.Random, p: Profile) -> Case:
    makers, weights = zip(*_HTTP_FAMILY, strict=True)
    return rng.choices(makers, weights)[0](rng, p)


_FAMILIES: list[tuple[Callable[[random.Random, Profile], Case], int]] = [
    (_field_case, 50),
    (_json_case, 20),
    (_http_case, 30),
]


def make_case(profile: Profile, seed: int, index: int) -> Case:
    """Case ``index`` of ``seed`` for ``profile``, the same on every run and machine."""
    rng = random.Random(f"{seed}/{profile.name}/{index}")
    makers, weights = zip(*_FAMILIES, strict=True)
    case = rng.choices(makers, weights)[0](rng, profile)
    return dataclasses.replace(case, seed=seed, index=index)


def valid_probe(profile: Profile) -> Case:
    """The request that must still succeed after a finding: a plain one-token chat."""
    body = json.dumps(
        {"model": profile.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ).encode()
    return _post(profile, CHAT, body, label="probe")
