"""A tiny stand-in for EngineCore that follows the engine contract, for HTTP-behaviour tests only
(error shapes, load shedding, readiness): it "generates" the prompt's tokens back, one per step,
the same in each of a request's n choices."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import CompletionOutput, RequestOutput
from engine.errors import InvalidRequestError


@dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_blocks: int = 64
    block_size: int = 16
    grammar_failures: dict[str, int] = field(default_factory=dict)


@dataclass
class _Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generated: int = 0


class FakeCore:
    def __init__(
        self,
        tokenizer,
        max_model_len: int = 256,
        max_num_seqs: int = 4,
        step_delay: float = 0.0,
        load_gate: threading.Event | None = None,
        fail_on_step: int | None = None,
        max_n: int = 128,
    ) -> None:
        if load_gate is not None:  # lets a test hold the "model load" open
            load_gate.wait(10)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_n = max_n
        self.vocab_size = len(tokenizer)
        self._max_num_seqs = max_num_seqs
        self._step_delay = step_delay
        self._fail_on_step = fail_on_step
        self._steps = 0
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._ids: set[str] = set()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if request_id in self._ids:
            raise InvalidRequestError(f"duplicate request id {request_id}")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError("token id out of vocabulary", param="prompt")
        if params.n > self.max_n:
            raise InvalidRequestError(f"n must be at most {self.max_n}", param="n")
        self._ids.add(request_id)
        self._waiting.append(_Req(request_id, list(prompt_token_ids), params))

    def abort(self, request_id: str) -> None:
        self._waiting = [r for r in self._waiting if r.request_id != request_id]
        self._running = [r for r in self._running if r.request_id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[RequestOutput]:
        self._steps += 1
        if self._fail_on_step is not None and self._steps >= self._fail_on_step:
            raise RuntimeError("simulated engine failure")
        while self._waiting and len(self._running) < self._max_num_seqs:
            req = self._waiting.pop(0)
            self._prompt_tokens += len(req.prompt)
            self._running.append(req)
        time.sleep(self._step_delay)
        outputs = []
        for req in list(self._running):
            token = req.prompt[req.generated % len(req.prompt)]
            req.generated += 1
            self._generation_tokens += req.params.n
            done = req.generated >= (req.params.max_tokens or 8)
            if done:
                self._running.remove(req)
            text = self.tokenizer.decode([token])
            reason = "length" if done else None
            outputs.append(
                RequestOutput(
                    req.request_id,
                    [CompletionOutput(i, [token], text, None, reason) for i in range(req.params.n)],
                    done,
                    len(req.prompt),
                    queue_time_s=0.0 if req.generated == 1 else None,
                )
            )
        return outputs

    def stats(self) -> FakeStats:
        return FakeStats(
            num_running=len(self._running),
            num_waiting=sum(r.params.n for r in self._waiting),  # sequences, as the core counts
            kv_cache_usage=len(self._running) / 64,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
        )
