"""OpenAI request bodies -> prompt token ids + SamplingParams, and the response/chunk shapes.

Parsing follows OpenAI's and vLLM's conventions: unknown fields are ignored, a field of the wrong
type is a 400 naming it, and a known field whose non-default value this engine cannot honour is a
400 too (rather than silently doing something else).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.errors import excerpt
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import CompletionOutput, RequestOutput, TokenLogprob

MAX_COMPLETION_LOGPROBS = 20
MAX_CHAT_TOP_LOGPROBS = 20
_INT64 = 2**63  # integer fields hold 64-bit values, as in OpenAI's and vLLM's schemas
# A token's string bounds the characters of text it stands for: a byte-level BPE token has one
# character per byte it covers, a SentencePiece one its text (a space as "▁"), a byte-fallback one
# "<0xAB>" for one byte, a special token its literal text. A normalizer can fold up to four
# characters into one (NFC: "α" and three combining marks -> "ᾆ"), so a prompt of more than
# max_model_len x longest token x 4 characters has more than max_model_len tokens and cannot fit.
# (Only tokenizers that fold whole runs, e.g. collapsing whitespace or fusing unknown characters,
# could fit more; LLM tokenizers do neither, and such a prompt would be mostly noise anyway.)
_NORMALIZER_FOLD = 4
_MISSING = object()


def longest_token_chars(tokenizer: Any) -> int:
    """The longest token string in the vocabulary (special and added tokens included)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this engine, checked before any templating or tokenising."""

    max_model_len: int
    max_n: int  # choices per request: --max-n, and never more than the queue bound holds
    vocab_size: int  # the model's: token ids in prompts and stop_token_ids are below it
    longest_token_chars: int

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.longest_token_chars * _NORMALIZER_FOLD

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse a prompt that cannot fit without paying for its template and tokenisation."""
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt's {chars} characters are more than that many tokens can hold (at most "
                f"{self.max_prompt_chars}). Please reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )


@dataclass
class GenerationRequest:
    """A parsed /v1/chat/completions or /v1/completions body. Its fields are checked; the prompt
    (messages, text or token ids) becomes ``prompt_token_ids`` in ``encode_prompt``, the costly
    part, which the server runs off the event loop."""

    kind: str  # "chat" | "completion"
    model: str | None
    prompt: Any  # chat: the messages as sent; completion: text, or checked token ids
    params: SamplingParams
    stream: bool
    include_usage: bool
    add_generation_prompt: bool = True
    prompt_token_ids: list[int] = field(default_factory=list)


# ---- field access with type checks ---------------------------------------------------------

_EXPECTED = {
    "int": "an integer",
    "number": "a number",
    "bool": "a boolean",
    "str": "a string",
    "dict": "an object",
    "list": "an array",
}
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}


def _bad(param: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}' {problem}", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "int":
        return _is_int(value)
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
        raise _bad(name, f"must be {_EXPECTED[kind]}, got {got}")
    if kind == "int" and not -_INT64 <= value < _INT64:
        raise _bad(name, "must be a 64-bit integer")
    if kind == "number":
        return _finite(name, value)
    return value


def _finite(name: str, value: float) -> float:
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise _bad(name, "must be a finite number")
    return number


def _get_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "must be a string or an array of strings")
    return stops


def check_token_ids(ids: list[int], param: str, vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _bad(
            param, f"holds token id {excerpt(str(bad))}, outside the vocabulary [0, {vocab_size})"
        )


def get_token_ids(body: dict, name: str, vocab_size: int) -> list[int]:
    """body[name] as a list of token ids below ``vocab_size``; absent or None give []."""
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise _bad(name, "must be an array of integers")
    check_token_ids(value, name, vocab_size)
    return value


def _reject_unsupported(body: dict) -> None:
    """Known OpenAI fields whose non-default values would change the meaning of the reply."""
    checks = [
        ("echo", body.get("echo") not in (None, False), "echo is not supported"),
        ("suffix", body.get("suffix") not in (None, ""), "suffix is not supported"),
        ("logit_bias", bool(body.get("logit_bias")), "logit_bias is not supported"),
        ("tools", bool(body.get("tools")), "tools are not supported by this engine"),
        (
            "response_format",
            isinstance(body.get("response_format"), dict)
            and body["response_format"].get("type") not in (None, "text"),
            "only response_format type 'text' is supported",
        ),
    ]
    for param, bad, message in checks:
        if bad:
            raise InvalidRequestError(message, param=param)
    best_of = get_field(body, "best_of", "int")
    if best_of is not None and best_of != get_field(body, "n", "int", 1):
        raise InvalidRequestError("best_of different from n is not supported", param="best_of")


def _choices(body: dict, max_n: int) -> int:
    n = get_field(body, "n", "int", 1)
    if not 1 <= n <= max_n:
        raise _bad("n", f"must be between 1 and {max_n} (this engine's limit), got {n}")
    return n


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    """The first of ``names`` that is set (chat: max_completion_tokens, then max_tokens)."""
    for name in names:
        value = get_field(body, name, "int")
        if value is not None:
            if value < 1:
                raise _bad(name, f"must be >= 1, got {value}")
            return value
    return default


def _sampling_params(
    body: dict, max_tokens: int | None, logprobs: int | None, limits: RequestLimits
) -> SamplingParams:
    return SamplingParams(
        n=_choices(body, limits.max_n),
        max_tokens=max_tokens,
        temperature=get_field(body, "temperature", "number", 1.0),
        top_p=get_field(body, "top_p", "number", 1.0),
        top_k=get_field(body, "top_k", "int", 0),
        min_p=get_field(body, "min_p", "number", 0.0),
        seed=get_field(body, "seed", "int"),
        presence_penalty=get_field(body, "presence_penalty", "number", 0.0),
        frequency_penalty=get_field(body, "frequency_penalty", "number", 0.0),
        repetition_penalty=get_field(body, "repetition_penalty", "number", 1.0),
        stop=_get_stop(body),
        # Deduplicated: the core checks every sampled token against this list.
        stop_token_ids=list(
            dict.fromkeys(get_token_ids(body, "stop_token_ids", limits.vocab_size))
        ),
        ignore_eos=get_field(body, "ignore_eos", "bool", False),
        logprobs=logprobs,
        include_stop_str_in_output=get_field(body, "include_stop_str_in_output", "bool", False),
    )


def _check_length(
    num_prompt: int, max_tokens: int | None, max_model_len: int, prompt_param: str
) -> None:
    requested = num_prompt + (max_tokens or 0)
    if num_prompt >= max_model_len or requested > max_model_len:
        completion = f"{max_tokens} in the completion" if max_tokens else "none left to generate"
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {requested} tokens ({num_prompt} in the prompt, {completion}). Please "
            "reduce the length of the prompt or of max_tokens.",
            param="max_tokens" if max_tokens and num_prompt < max_model_len else prompt_param,
            code="context_length_exceeded",
        )


def _common(body: Any) -> tuple[str | None, bool, bool]:
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    model = get_field(body, "model", "str")
    stream = get_field(body, "stream", "bool", False)
    options = get_field(body, "stream_options", "dict", {})
    include_usage = get_field(options, "include_usage", "bool", False)
    get_field(body, "user", "str")  # accepted, type-checked, unused
    _reject_unsupported(body)
    return model, stream, include_usage


def _encode(tokenizer: Any, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    except Exception as error:  # the tokenizer refusing some content: the client's text
        raise _bad(param, f"cannot be tokenised: {excerpt(str(error))}") from error


def encode_prompt(request: GenerationRequest, tokenizer: Any, limits: RequestLimits) -> list[int]:
    """The prompt's token ids, length-checked: the chat template and tokenising, which take
    seconds for a long prompt (run it off the event loop, with a tokenizer of its own thread)."""
    if request.kind == "chat":
        param = "messages"
        messages = parse_messages(request.prompt)
        limits.check_prompt_chars(sum(len(m["content"]) for m in messages), param)
        ids = apply_chat_template(tokenizer, messages, request.add_generation_prompt)
    else:
        param = "prompt"
        prompt = request.prompt
        ids = _encode(tokenizer, prompt, param) if isinstance(prompt, str) else prompt
    if not ids:
        raise _bad(param, "must not be empty")
    _check_length(len(ids), request.params.max_tokens, limits.max_model_len, param)
    return ids


# ---- chat ----------------------------------------------------------------------------------

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _message_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(
                    f"messages[{index}].content",
                    f"part type {excerpt(repr(kind))} is not supported (only 'text' parts)",
                )
            if not isinstance(part.get("text"), str):
                raise _bad(f"messages[{index}].content", "text part needs a string 'text'")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{index}].content", "must be a string or an array of text parts")


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """A request's ``messages`` as the chat template takes them."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "must be a non-empty array of messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", "must be an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(
                f"messages[{i}].role",
                f"{excerpt(repr(role))} is not supported (system, developer, user, assistant)",
            )
        if message.get("tool_calls"):
            raise _bad(f"messages[{i}].tool_calls", "tool calls are not supported")
        messages.append({"role": _ROLES[role], "content": _message_text(i, message.get("content"))})
    return messages


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as error:  # jinja raises for conversations the template forbids
        raise InvalidRequestError(
            f"chat template error: {excerpt(str(error))}", param="messages"
        ) from error
    # The template already writes any BOS/special tokens it wants.
    return _encode(tokenizer, text, "messages", add_special_tokens=False)


def _chat_logprobs(body: dict) -> int | None:
    top = get_field(body, "top_logprobs", "int")
    if not get_field(body, "logprobs", "bool", False):
        if top is not None:
            raise _bad("top_logprobs", "requires logprobs: true")
        return None
    if top is not None and not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
        raise _bad("top_logprobs", f"must be between 0 and {MAX_CHAT_TOP_LOGPROBS}")
    return top or 0


def parse_chat_request(body: Any, limits: RequestLimits) -> GenerationRequest:
    """The body's fields, checked (cheap: for the event loop); the messages are checked with the
    template work in encode_prompt."""
    model, stream, include_usage = _common(body)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise _bad("messages", "must be a non-empty array of messages")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    params = _sampling_params(body, max_tokens, _chat_logprobs(body), limits)
    return GenerationRequest(
        "chat",
        model,
        body["messages"],
        params,
        stream,
        include_usage,
        add_generation_prompt=get_field(body, "add_generation_prompt", "bool", True),
    )


# ---- completions ---------------------------------------------------------------------------


def _completion_prompt(prompt: Any, max_tokens: int | None, limits: RequestLimits) -> Any:
    """A non-empty string or token-id list, or a one-element list of either. Text is only
    measured here; token ids are checked in full (cheap: there are fewer than max_model_len)."""
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise _bad("prompt", "batches of several prompts are not supported; send one per request")
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_int(prompt[0]):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        limits.check_prompt_chars(len(prompt), "prompt")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt", "must be a non-empty string or array of token ids")
    _check_length(len(prompt), max_tokens, limits.max_model_len, "prompt")  # before the scan
    if not all(_is_int(t) for t in prompt):
        raise _bad("prompt", "must be a string or an array of token ids (integers)")
    check_token_ids(prompt, "prompt", limits.vocab_size)
    return prompt


def parse_completion_request(body: Any, limits: RequestLimits) -> GenerationRequest:
    """The body's fields, checked (cheap: for the event loop); a text prompt is tokenised in
    encode_prompt."""
    model, stream, include_usage = _common(body)
    if "prompt" not in body:
        raise _bad("prompt", "is required")
    max_tokens = _max_tokens(body, ("max_tokens",), 16)  # OpenAI's default for completions
    logprobs = get_field(body, "logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise _bad("logprobs", f"must be between 0 and {MAX_COMPLETION_LOGPROBS}")
    params = _sampling_params(body, max_tokens, logprobs, limits)
    prompt = _completion_prompt(body["prompt"], max_tokens, limits)
    return GenerationRequest("completion", model, prompt, params, stream, include_usage)


# ---- /tokenize -----------------------------------------------------------------------------


def parse_tokenize_request(body: dict, limits: RequestLimits) -> Callable[[Any], list[int]]:
    """/tokenize's fields, checked; returns the tokenising (of messages or text) to run off the
    event loop, given that thread's tokenizer."""
    if "messages" in body:
        add_generation_prompt = get_field(body, "add_generation_prompt", "bool", True)

        def chat(tokenizer: Any) -> list[int]:
            messages = parse_messages(body["messages"])
            limits.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
            return apply_chat_template(tokenizer, messages, add_generation_prompt)

        return chat
    prompt = get_field(body, "prompt", "str")
    if prompt is None:
        raise _bad("prompt", "(a string) or 'messages' is required")
    limits.check_prompt_chars(len(prompt), "prompt")
    special = get_field(body, "add_special_tokens", "bool", True)
    return lambda tokenizer: _encode(tokenizer, prompt, "prompt", special)


# ---- responses -----------------------------------------------------------------------------


def new_request_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class ResponseBuilder:
    """Turns one request's RequestOutput deltas into OpenAI chunks or a final response body."""

    def __init__(self, request: GenerationRequest, request_id: str, model: str, tokenizer: Any):
        self.request = request
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._choices = [_Choice() for _ in range(request.params.n)]
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self._is_chat = request.kind == "chat"

    # shared pieces

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        body = {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.request.stream and self.request.include_usage:
            body["usage"] = None
        return body

    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self._choices)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
        }

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for entry in entries:
            record = item(entry.token_id, entry.logprob)
            record["top_logprobs"] = [item(t, lp) for t, lp in entry.top]
            content.append(record)
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, entries: list[TokenLogprob], offset: int) -> dict:
        tokens, offsets = [], []
        for entry in entries:
            text = self._token_text(entry.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _logprobs(self, choice: _Choice, entries: list[TokenLogprob] | None) -> dict | None:
        if self.request.params.logprobs is None:
            return None
        entries = entries or []
        if self._is_chat:
            return self._chat_logprobs(entries)
        offset = sum(len(t) for t in choice.text)
        return self._completion_logprobs(entries, offset)

    def _absorb(self, delta: CompletionOutput) -> _Choice:
        choice = self._choices[delta.index]
        choice.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
        return choice

    # streaming

    def first_chunks(self) -> list[dict]:
        """Chat opens each choice with the assistant role; completions have no preamble."""
        if not self._is_chat:
            return []
        return [
            self._envelope(
                "chat.completion.chunk",
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in range(len(self._choices))
        ]

    def chunks(self, out: RequestOutput) -> list[dict]:
        """The chunks for one step's delta: text (if any) then a final chunk per finished choice."""
        chunks = []
        for delta in out.outputs:
            offset_choice = self._choices[delta.index]
            logprobs = self._logprobs(offset_choice, delta.logprobs) if delta.token_ids else None
            choice = self._absorb(delta)
            if delta.text or logprobs is not None:
                if self._is_chat:
                    body = {
                        "index": delta.index,
                        "delta": {"content": delta.text},
                        "logprobs": logprobs,
                        "finish_reason": None,
                    }
                else:
                    body = {
                        "index": delta.index,
                        "text": delta.text,
                        "logprobs": logprobs,
                        "finish_reason": None,
                    }
                chunks.append(self._chunk(body))
                choice.text.append(delta.text)
            if delta.finish_reason is not None:
                if self._is_chat:
                    body = {
                        "index": delta.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": delta.finish_reason,
                    }
                else:
                    body = {
                        "index": delta.index,
                        "text": "",
                        "logprobs": None,
                        "finish_reason": delta.finish_reason,
                    }
                chunks.append(self._chunk(body))
        return chunks

    def _chunk(self, choice: dict) -> dict:
        obj = "chat.completion.chunk" if self._is_chat else "text_completion"
        return self._envelope(obj, [choice])

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self._is_chat else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = self.usage()
        return body

    # non-streaming

    def add(self, out: RequestOutput) -> None:
        for delta in out.outputs:
            self._absorb(delta).text.append(delta.text)

    def response(self) -> dict:
        choices = []
        for i, choice in enumerate(self._choices):
            text = "".join(choice.text)
            logprobs = None
            if self.request.params.logprobs is not None:
                logprobs = (
                    self._chat_logprobs(choice.logprobs)
                    if self._is_chat
                    else self._completion_logprobs(choice.logprobs, 0)
                )
            if self._is_chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                    }
                )
        obj = "chat.completion" if self._is_chat else "text_completion"
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
