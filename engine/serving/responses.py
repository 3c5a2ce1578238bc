"""One request's RequestOutput deltas -> OpenAI's streamed chunks or final response body.

A chat request with tools splits each choice's text into content and tool calls
(engine/serving/tools/splitter.py): streamed, as ``delta.tool_calls`` pieces the official SDK
accumulates; whole, as ``message.tool_calls``. A choice that made calls and stopped by itself
finishes with ``tool_calls``."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.core.sequence import CompletionOutput, RequestOutput, TokenLogprob
from engine.serving.requests import GenerationRequest
from engine.serving.tools.splitter import CallPiece, Piece, new_splitter, split_reply

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
        tools = request.tools if self._is_chat else None
        self._splitters = [new_splitter(tools) for _ in self._choices]

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
            if self._is_chat:
                bodies = self._chat_bodies(delta, logprobs)
            else:
                bodies = self._completion_bodies(delta, logprobs)
            choice.text.append(delta.text)
            chunks.extend(self._chunk(body) for body in bodies)
        return chunks

    def _chat_bodies(self, delta: CompletionOutput, logprobs: dict | None) -> list[dict]:
        splitter = self._splitters[delta.index]
        if splitter is None:
            deltas = [{"content": delta.text}] if delta.text or logprobs is not None else []
        else:
            pieces = splitter.feed(delta.text) if delta.text else []
            if delta.finish_reason is not None:
                pieces += splitter.finish()
            deltas = [_chat_delta(piece) for piece in pieces]
            if logprobs is not None and not deltas:  # the text is held back, its logprobs not
                deltas = [{}]
        bodies = [
            {"index": delta.index, "delta": d, "logprobs": None, "finish_reason": None}
            for d in deltas
        ]
        if bodies:
            bodies[0]["logprobs"] = logprobs
        if delta.finish_reason is not None:
            reason = _finish_reason(delta.finish_reason, splitter.calls if splitter else 0)
            bodies.append(
                {"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": reason}
            )
        return bodies

    def _completion_bodies(self, delta: CompletionOutput, logprobs: dict | None) -> list[dict]:
        bodies = []
        if delta.text or logprobs is not None:
            bodies.append(
                {
                    "index": delta.index,
                    "text": delta.text,
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
            )
        if delta.finish_reason is not None:
            bodies.append(
                {
                    "index": delta.index,
                    "text": "",
                    "logprobs": None,
                    "finish_reason": delta.finish_reason,
                }
            )
        return bodies

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
                content, calls = split_reply(self.request.tools, text)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
                choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": _finish_reason(choice.finish_reason, len(calls)),
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


def _chat_delta(piece: Piece) -> dict:
    """A splitter's piece as a chat chunk's delta; a call's first piece names it."""
    if not isinstance(piece, CallPiece):
        return {"content": piece.text}
    call: dict[str, Any] = {"index": piece.index}
    if piece.id is not None:
        call.update(id=piece.id, type="function")
        call["function"] = {"name": piece.name, "arguments": piece.arguments}
    else:
        call["function"] = {"arguments": piece.arguments}
    return {"tool_calls": [call]}


def _finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's ``tool_calls`` for a choice that called tools and stopped by itself."""
    return "tool_calls" if calls and reason == "stop" else reason
