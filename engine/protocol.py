"""OpenAI request bodies -> prompt token ids + SamplingParams, and the response/chunk shapes.

Parsing follows OpenAI's and vLLM's conventions: unknown fields are ignored, a field of the wrong
type is a 400 naming it, and a known field whose non-default value this engine cannot honour is a
400 too (rather than silently doing something else).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.errors import excerpt
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import CompletionOutput, RequestOutput, TokenLogprob

MAX_COMPLETION_LOGPROBS = 20
# Token strings bound the characters a token can stand for, except where a normalizer folds
# several characters into one (NFC composition, say); twice over leaves room for that.
_NORMALIZER_SLACK = 2
_MISSING = object()


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this engine, checked before any tokenising."""

    max_model_len: int
    max_n: int
    longest_token_chars: int  # the vocabulary's longest token string

    @property
    def max_prompt_chars(self) -> int:
        """A prompt longer than this cannot fit in max_model_len tokens, so it is refused
        without paying for its template and tokenisation."""
        return self.max_model_len * self.longest_token_chars * _NORMALIZER_SLACK

    def check_prompt_chars(self, chars: int, param: str) -> None:
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
    """A parsed /v1/chat/completions or /v1/completions body."""

    kind: str  # "chat" | "completion"
    model: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


# ---- field access with type checks ---------------------------------------------------------


def _bad(param: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}' {problem}", param=param)


def get_field(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """Return body[name] checked against ``kind``; None and absent give ``default``."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    is_bool = isinstance(value, bool)
    ok = {
        "int": isinstance(value, int) and not is_bool,
        "number": isinstance(value, (int, float)) and not is_bool,
        "bool": is_bool,
        "str": isinstance(value, str),
        "dict": isinstance(value, dict),
        "list": isinstance(value, list),
    }[kind]
    if not ok:
        expected = {
            "int": "an integer",
            "number": "a number",
            "bool": "a boolean",
            "str": "a string",
            "dict": "an object",
            "list": "an array",
        }[kind]
        raise _bad(name, f"must be {expected}, got {type(value).__name__}")
    return float(value) if kind == "number" else value


def _get_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise _bad("stop", "must be a string or an array of strings")


def get_int_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return value
    raise _bad(name, "must be an array of integers")


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
    if n > max_n:
        raise _bad("n", f"must be at most {max_n} (this engine's limit), got {n}")
    return n


def _sampling_params(
    body: dict, max_tokens: int | None, logprobs: int | None, max_n: int
) -> SamplingParams:
    temperature = get_field(body, "temperature", "number", 1.0)
    top_k = get_field(body, "top_k", "int", 0)
    return SamplingParams(
        n=_choices(body, max_n),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=get_field(body, "top_p", "number", 1.0),
        top_k=top_k,
        min_p=get_field(body, "min_p", "number", 0.0),
        seed=get_field(body, "seed", "int"),
        presence_penalty=get_field(body, "presence_penalty", "number", 0.0),
        frequency_penalty=get_field(body, "frequency_penalty", "number", 0.0),
        repetition_penalty=get_field(body, "repetition_penalty", "number", 1.0),
        stop=_get_stop(body),
        stop_token_ids=get_int_list(body, "stop_token_ids"),
        ignore_eos=get_field(body, "ignore_eos", "bool", False),
        logprobs=logprobs,
        include_stop_str_in_output=get_field(body, "include_stop_str_in_output", "bool", False),
    )


def _check_length(num_prompt: int, max_tokens: int | None, max_model_len: int) -> None:
    requested = num_prompt + (max_tokens or 0)
    if num_prompt >= max_model_len or requested > max_model_len:
        completion = f"{max_tokens} in the completion" if max_tokens else "none left to generate"
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {requested} tokens ({num_prompt} in the prompt, {completion}). Please "
            "reduce the length of the prompt or of max_tokens.",
            param="max_tokens" if max_tokens and num_prompt < max_model_len else "messages",
            code="context_length_exceeded",
        )


def _common(body: dict) -> tuple[str | None, bool, bool]:
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    model = get_field(body, "model", "str")
    stream = get_field(body, "stream", "bool", False)
    options = get_field(body, "stream_options", "dict", {})
    include_usage = get_field(options, "include_usage", "bool", False)
    get_field(body, "user", "str")  # accepted, type-checked, unused
    _reject_unsupported(body)
    return model, stream, include_usage


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


def parse_messages(body: dict) -> list[dict[str, str]]:
    raw = body.get("messages")
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
        raise InvalidRequestError(f"chat template error: {error}", param="messages") from error
    # The template already writes any BOS/special tokens it wants.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_chat_request(body: Any, tokenizer: Any, limits: RequestLimits) -> GenerationRequest:
    model, stream, include_usage = _common(body)
    messages = parse_messages(body)
    limits.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
    max_tokens = get_field(body, "max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", "int")
    logprobs = None
    if get_field(body, "logprobs", "bool", False):
        logprobs = get_field(body, "top_logprobs", "int", 0)
    elif get_field(body, "top_logprobs", "int") is not None:
        raise InvalidRequestError("top_logprobs requires logprobs: true", param="top_logprobs")
    params = _sampling_params(body, max_tokens, logprobs, limits.max_n)
    add_generation_prompt = get_field(body, "add_generation_prompt", "bool", True)
    prompt_ids = apply_chat_template(tokenizer, messages, add_generation_prompt)
    _check_length(len(prompt_ids), max_tokens, limits.max_model_len)
    return GenerationRequest("chat", model, prompt_ids, params, stream, include_usage)


# ---- completions ---------------------------------------------------------------------------


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def completion_prompt_ids(prompt: Any, tokenizer: Any, limits: RequestLimits) -> list[int]:
    """A string, a token-id list, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_token_list(prompt):
        prompt = prompt[0]
    if isinstance(prompt, str):
        limits.check_prompt_chars(len(prompt), "prompt")
        ids = list(tokenizer(prompt)["input_ids"])
    elif _is_token_list(prompt):
        ids = list(prompt)
    elif isinstance(prompt, list):
        raise _bad("prompt", "batches of several prompts are not supported; send one per request")
    else:
        raise _bad("prompt", "must be a string or an array of token ids")
    if not ids:
        raise _bad("prompt", "must not be empty")
    return ids


def parse_completion_request(body: Any, tokenizer: Any, limits: RequestLimits) -> GenerationRequest:
    model, stream, include_usage = _common(body)
    if "prompt" not in body:
        raise _bad("prompt", "is required")
    max_tokens = get_field(body, "max_tokens", "int", 16)  # OpenAI's default for completions
    logprobs = get_field(body, "logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise _bad("logprobs", f"must be between 0 and {MAX_COMPLETION_LOGPROBS}")
    params = _sampling_params(body, max_tokens, logprobs, limits.max_n)
    prompt_ids = completion_prompt_ids(body["prompt"], tokenizer, limits)  # the costly part last
    _check_length(len(prompt_ids), max_tokens, limits.max_model_len)
    return GenerationRequest("completion", model, prompt_ids, params, stream, include_usage)


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
