"""Grammar compilation off the step loop, with a cache keyed by the constraint.

A compile checks the constraint (a JSON schema against its metaschema first), builds the
llguidance grammar, and warms one matcher up by computing its first mask (where llguidance does
most of its lazy work); each sequence then starts from a copy of that matcher, which costs
microseconds. Compiles run on a thread pool of their own, so neither the event loop nor the
step loop waits for one: the server awaits the compile at admission (a bad schema is a 400
before any streaming), and the core admits a request once its grammar is ready.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.torch
import torch

from engine.errors import InvalidRequestError
from engine.structured.bitmask import allocate_bitmask
from engine.structured.grammars import Constraint, grammar_for, library_error
from engine.structured.matcher import GrammarMatcher

MAX_CACHED_GRAMMARS = 256


class CompiledGrammar:
    """A checked grammar; `matcher()` starts a sequence on it."""

    def __init__(self, prototype: llguidance.LLMatcher) -> None:
        self._prototype = prototype  # never advanced: only copied

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one tokenizer on `threads` worker threads; keeps the latest
    `max_cached` results (failures too: a bad schema sent again is refused without a compile)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int] | set[int],
        threads: int = 1,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        # Serialised here, on the caller's thread: HF tokenizers are not thread-safe, and the
        # workers build llguidance's tokenizer from this text when the first compile needs it.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer_json = backend.to_str() if backend is not None else None
        self._vocab_size = vocab_size  # the logits' width, which the masks cover
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._max_cached = max_cached
        self._cache: OrderedDict[Constraint, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="engine-grammar")

    def submit(self, constraint: Constraint) -> Future[CompiledGrammar]:
        """The compile of `constraint`: the cached one, or one started now. Its result raises
        InvalidRequestError for a constraint that cannot be compiled."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(constraint)
                return future
            future = self._executor.submit(self._compile, constraint)
            self._cache[constraint] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return future

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The same, waiting for the result (offline use and tests)."""
        return self.submit(constraint).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        grammar, schema = grammar_for(constraint)
        tokenizer = self._tokenizer()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise library_error(constraint, messages[0] if messages else "", schema)
        prototype = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        warm = allocate_bitmask(1, self._vocab_size)
        llguidance.torch.fill_next_token_bitmask(prototype, warm, 0)
        if prototype.is_error():
            raise library_error(constraint, prototype.get_error(), schema)
        if not bool(torch.any(warm != 0)):
            raise library_error(constraint, "no token can start an output that matches", schema)
        return CompiledGrammar(prototype)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built by the first compile (about half a second
        for a 49k vocabulary)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                if self._tokenizer_json is None:
                    raise InvalidRequestError(
                        "structured outputs need a fast (Rust) tokenizer, which this model lacks",
                        param="response_format",
                    )
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
                )
            return self._ll_tokenizer
