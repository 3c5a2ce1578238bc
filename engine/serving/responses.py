"""One request's RequestOutput deltas -> OpenAI's streamed chunks or final response body."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.core.sequence import CompletionOutput, RequestOutput, TokenLogprob
from engine.serving.requests import GenerationRequest

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
