"""One sequence's place in its grammar: which tokens may come next, advanced by each token the
sequence takes. Every choice of an ``n > 1`` request has its own."""

from __future__ import annotations

import llguidance
import torch

from engine.structured.bitmask import fill_row, fill_rows
from engine.structured.grammars import failure_kind


class GrammarMatcher:
    """An llguidance matcher and the number of tokens it has taken."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self.num_tokens = 0

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and can take no further token (the sequence ends here)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    @property
    def failure_kind(self) -> str:
        """Why it is in error (engine.structured.grammars.failure_kind)."""
        return failure_kind(self._matcher)

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (the matcher then stays in error) if the grammar forbids
        it, or if it leads where the grammar can go no further without being complete (a dead
        end: `{"a": {"$ref": "#/properties/a"}}` stops after `{"a": `)."""
        ok = self._matcher.consume_token(token_id)
        if ok:
            self.num_tokens += 1
        return ok and not (self._matcher.is_stopped() and not self._matcher.is_accepting())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        fill_row(self._matcher, bitmask, row)


class BitmaskFiller:
    """Fills the rows of several matchers at once, on llguidance's own threads (it drops the GIL)
    when there is more than one."""

    def __init__(self, threads: int) -> None:
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def fill(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill(bitmask, 0)
            return
        pairs = [(m._matcher, row) for row, m in enumerate(matchers)]
        fill_rows(self._executor, pairs, bitmask)
