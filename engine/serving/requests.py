"""OpenAI request bodies -> checked fields, SamplingParams and prompt token ids.

Parsing follows OpenAI's and vLLM's conventions: unknown fields are ignored, a field of the wrong
type is a 400 naming it, and a known field whose non-default value this engine cannot honour is a
400 too (rather than silently doing something else). It runs in two steps: `parse_*_request`
checks every field on the event loop (cheap), then `encode_prompt` tokenises on the prompt thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.core.sampling_params import SamplingParams
from engine.errors import InvalidRequestError
from engine.serving.prompts import (
    apply_chat_template,
    encode_text,
    parse_messages,
    prompt_chars,
    prompt_items,
)
from engine.serving.request_fields import (
    bad_field,
    check_token_ids,
    get_field,
    get_token_ids,
    is_int,
)
from engine.serving.structured_fields import parse_structured
from engine.serving.tools.constraint import forced_call_constraint
from engine.serving.tools.request import ToolRequest, parse_tool_request

MAX_COMPLETION_LOGPROBS = 20
MAX_CHAT_TOP_LOGPROBS = 20
# A token's string bounds the characters of text it stands for: a byte-level BPE token has one
# character per byte it covers, a SentencePiece one its text (a space as "▁"), a byte-fallback one
# "<0xAB>" for one byte, a special token its literal text. A normalizer can fold up to four
# characters into one (NFC: "α" and three combining marks -> "ᾆ"), so a prompt of more than
# max_model_len x longest token x 4 characters has more than max_model_len tokens and cannot fit.
# (Only tokenizers that fold whole runs, e.g. collapsing whitespace or fusing unknown characters,
# could fit more; LLM tokenizers do neither, and such a prompt would be mostly noise anyway.)
_NORMALIZER_FOLD = 4


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

    def check_prompt_items(self, items: int, param: str) -> None:
        """Refuse a chat of more messages (and earlier tool calls) than max_model_len: each
        renders to one token at least, so its template work would be spent on a refusal."""
        if items > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the "
                f"chat's {items} messages and tool calls take one token each at least. Please "
                "reduce the number of messages.",
                param=param,
                code="context_length_exceeded",
            )

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
    tools: ToolRequest | None = None  # chat: the declared tools and tool_choice
    prompt_token_ids: list[int] = field(default_factory=list)


def _get_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_field("stop", "must be a string or an array of strings")
    return stops


def _reject_unsupported(body: dict) -> None:
    """Known OpenAI fields whose non-default values would change the meaning of the reply."""
    checks = [
        ("echo", body.get("echo") not in (None, False), "echo is not supported"),
        ("suffix", body.get("suffix") not in (None, ""), "suffix is not supported"),
        ("logit_bias", bool(body.get("logit_bias")), "logit_bias is not supported"),
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
        raise bad_field("n", f"must be between 1 and {max_n} (this engine's limit), got {n}")
    return n


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    """The first of ``names`` that is set (chat: max_completion_tokens, then max_tokens)."""
    for name in names:
        value = get_field(body, name, "int")
        if value is not None:
            if value < 1:
                raise bad_field(name, f"must be >= 1, got {value}")
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
        structured=parse_structured(body),
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


def encode_prompt(request: GenerationRequest, tokenizer: Any, limits: RequestLimits) -> list[int]:
    """The prompt's token ids, length-checked: the chat template and tokenising, which take
    seconds for a long prompt (run it off the event loop, with a tokenizer of its own thread)."""
    if request.kind == "chat":
        param = "messages"
        ids = _encode_chat(
            tokenizer, request.prompt, request.add_generation_prompt, limits, request.tools
        )
    else:
        param = "prompt"
        prompt = request.prompt
        ids = encode_text(tokenizer, prompt, param) if isinstance(prompt, str) else prompt
    if not ids:
        raise bad_field(param, "must not be empty")
    _check_length(len(ids), request.params.max_tokens, limits.max_model_len, param)
    return ids


def _encode_chat(
    tokenizer: Any,
    raw_messages: Any,
    add_generation_prompt: bool,
    limits: RequestLimits,
    tools: ToolRequest | None,
) -> list[int]:
    """A chat's token ids through the template, its text measured against the prompt cap first."""
    messages = parse_messages(raw_messages)
    limits.check_prompt_items(prompt_items(messages), "messages")
    if tools is not None:
        tools.check_parameter_schemas()
    tool_dicts = [tool.as_openai() for tool in tools.tools] if tools else None
    limits.check_prompt_chars(prompt_chars(messages, tool_dicts), "messages")
    return apply_chat_template(
        tokenizer,
        messages,
        add_generation_prompt,
        tool_dicts,
        # what the template made of them, before it is tokenised
        check_text=lambda text: limits.check_prompt_chars(len(text), "messages"),
    )


# ---- chat ----------------------------------------------------------------------------------


def _chat_logprobs(body: dict) -> int | None:
    top = get_field(body, "top_logprobs", "int")
    if not get_field(body, "logprobs", "bool", False):
        if top is not None:
            raise bad_field("top_logprobs", "requires logprobs: true")
        return None
    if top is not None and not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
        raise bad_field("top_logprobs", f"must be between 0 and {MAX_CHAT_TOP_LOGPROBS}")
    return top or 0


def parse_chat_request(body: Any, limits: RequestLimits) -> GenerationRequest:
    """The body's fields, checked (cheap: for the event loop); the messages are checked with the
    template work in encode_prompt."""
    model, stream, include_usage = _common(body)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise bad_field("messages", "must be a non-empty array of messages")
    limits.check_prompt_items(len(body["messages"]), "messages")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    params = _sampling_params(body, max_tokens, _chat_logprobs(body), limits)
    tools = parse_tool_request(body)
    if tools is not None and (constraint := forced_call_constraint(tools)) is not None:
        if params.structured is not None:
            raise bad_field(
                "tool_choice",
                "'required' or a named function cannot be combined with response_format",
            )
        params.structured = constraint
    return GenerationRequest(
        "chat",
        model,
        body["messages"],
        params,
        stream,
        include_usage,
        add_generation_prompt=get_field(body, "add_generation_prompt", "bool", True),
        tools=tools,
    )


# ---- completions ---------------------------------------------------------------------------


def _completion_prompt(prompt: Any, max_tokens: int | None, limits: RequestLimits) -> Any:
    """A non-empty string or token-id list, or a one-element list of either. Text is only
    measured here; token ids are checked in full (cheap: there are fewer than max_model_len)."""
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise bad_field(
            "prompt", "batches of several prompts are not supported; send one per request"
        )
    if isinstance(prompt, list) and len(prompt) == 1 and not is_int(prompt[0]):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        limits.check_prompt_chars(len(prompt), "prompt")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise bad_field("prompt", "must be a non-empty string or array of token ids")
    _check_length(len(prompt), max_tokens, limits.max_model_len, "prompt")  # before the scan
    if not all(is_int(t) for t in prompt):
        raise bad_field("prompt", "must be a string or an array of token ids (integers)")
    check_token_ids(prompt, "prompt", limits.vocab_size)
    return prompt


def parse_completion_request(body: Any, limits: RequestLimits) -> GenerationRequest:
    """The body's fields, checked (cheap: for the event loop); a text prompt is tokenised in
    encode_prompt."""
    model, stream, include_usage = _common(body)
    if "prompt" not in body:
        raise bad_field("prompt", "is required")
    max_tokens = _max_tokens(body, ("max_tokens",), 16)  # OpenAI's default for completions
    logprobs = get_field(body, "logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_field("logprobs", f"must be between 0 and {MAX_COMPLETION_LOGPROBS}")
    params = _sampling_params(body, max_tokens, logprobs, limits)
    prompt = _completion_prompt(body["prompt"], max_tokens, limits)
    return GenerationRequest("completion", model, prompt, params, stream, include_usage)


# ---- /tokenize -----------------------------------------------------------------------------


def parse_tokenize_request(body: dict, limits: RequestLimits) -> Callable[[Any], list[int]]:
    """/tokenize's fields, checked; returns the tokenising (of messages or text) to run off the
    event loop, given that thread's tokenizer."""
    if "messages" in body:
        if isinstance(body["messages"], list):  # its length is free: before any parsing
            limits.check_prompt_items(len(body["messages"]), "messages")
        add_generation_prompt = get_field(body, "add_generation_prompt", "bool", True)
        tools = parse_tool_request(body)

        return lambda tokenizer: _encode_chat(
            tokenizer, body["messages"], add_generation_prompt, limits, tools
        )
    prompt = get_field(body, "prompt", "str")
    if prompt is None:
        raise bad_field("prompt", "(a string) or 'messages' is required")
    limits.check_prompt_chars(len(prompt), "prompt")
    special = get_field(body, "add_special_tokens", "bool", True)
    return lambda tokenizer: encode_text(tokenizer, prompt, "prompt", special)
