"""Offline API: generate completions for a batch of prompts or chats in one call."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import TokenLogprob
from engine.errors import InvalidRequestError

Message = dict[str, str]


@dataclass
class GeneratedChoice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[GeneratedChoice]
    num_cached_tokens: int = 0


class LLM:
    """``LLM("path/to/model").generate(["Hello"], SamplingParams(max_tokens=32))``."""

    def __init__(self, model: str, **engine_config_kwargs: object) -> None:
        self.engine = EngineCore(EngineConfig(model=model, **engine_config_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        params: SamplingParams | None = None,
    ) -> list[GenerationResult]:
        """Completions for each prompt (text or token ids), in input order."""
        if isinstance(prompts, str):
            items: list[str | list[int]] = [prompts]
        elif prompts and all(isinstance(t, int) for t in prompts):
            items = [list(prompts)]  # one prompt given as token ids
        else:
            items = list(prompts)
        encoded = [
            (p, self.tokenizer(p)["input_ids"]) if isinstance(p, str) else (None, p) for p in items
        ]
        return self._run(encoded, params or SamplingParams())

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | None = None,
    ) -> list[GenerationResult]:
        """Assistant replies to one conversation or a list of them, via the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
            # The template already holds any BOS text, so add no special tokens again.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            encoded.append((text, ids))
        return self._run(encoded, params or SamplingParams())

    def _run(
        self, encoded: list[tuple[str | None, list[int]]], params: SamplingParams
    ) -> list[GenerationResult]:
        results: dict[str, GenerationResult] = {}
        try:
            for prompt, ids in encoded:
                if not isinstance(ids, SequenceABC):
                    raise InvalidRequestError("each prompt must be a string or token ids")
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, list(ids), params)
                results[request_id] = GenerationResult(
                    request_id,
                    prompt,
                    list(ids),
                    [GeneratedChoice(index=i) for i in range(params.n)],
                )
            pending = set(results)
            while pending:
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"engine lost requests {sorted(pending)}")
                for out in self.engine.step():
                    result = results.get(out.request_id)
                    if result is None:  # a request added directly to the engine by someone else
                        continue
                    result.num_cached_tokens = out.num_cached_tokens
                    for delta in out.outputs:
                        choice = result.outputs[delta.index]
                        choice.text += delta.text
                        choice.token_ids.extend(delta.token_ids)
                        choice.finish_reason = delta.finish_reason or choice.finish_reason
                        if delta.logprobs is not None:
                            choice.logprobs = (choice.logprobs or []) + delta.logprobs
                    if out.finished:
                        pending.discard(out.request_id)
        except BaseException:
            for request_id in results:  # leave the engine clean for the next call
                self.engine.abort(request_id)
            raise
        return list(results.values())
