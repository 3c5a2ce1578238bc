"""A grammar-compile worker: a child process of the engine (``python -m engine.structured.worker
PARENT_PID``) that compiles constraints where a crash, a runaway compile or a memory bomb cannot
reach the engine (engine.structured.workers drives it).

Its first message gives the tokenizer and its limits; then, per constraint, it checks the static
limits (engine.structured.limits), builds the grammar (the metaschema check included), computes
the first mask and probes a short random walk through the grammar, so that a grammar the library
gives up on after a token or two is refused before any generation; it answers with the grammar
text, which the engine then builds again in its own process (same code, same input, a larger
stack: what finished here finishes there), and with the bytes the grammar took here, which the
engine's grammar cache is charged. The compile runs on a thread with a fixed stack, under an
address-space limit and a lower CPU priority than the engine's step loop.
"""

from __future__ import annotations

import ctypes
import os
import random
import resource
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from engine.errors import InvalidRequestError
from engine.structured.grammars import (
    failure_kind,
    grammar_for,
    library_error,
    load_constraint_schema,
)
from engine.structured.limits import GRAMMAR_TOO_COMPLEX, ConstraintLimits, check_constraint
from engine.structured.wire import read_message, write_message

PROBE_TOKENS = 16  # tokens of the random walk that probes a compiled grammar
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Job:
    kind: str
    value: str


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _heap_in_use() -> Any:
    """Bytes malloc has handed out and not had back (all arenas, mmapped chunks included), the
    grammar library's allocations among them; None where glibc's mallinfo2 is missing."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return lambda: None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


def _malloc_trim() -> Any:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:
        return lambda: None
    return lambda: trim(0)


class Compiler:
    """The worker's compiles, for one tokenizer."""

    def __init__(self, init: dict[str, Any]) -> None:
        self.vocab_size: int = init["vocab_size"]
        self.limits = ConstraintLimits(**init["limits"])
        self.tokenizer = llguidance.LLTokenizer(
            init["tokenizer"], n_vocab=self.vocab_size, eos_token=init["eos_token_ids"]
        )
        self._in_use = _heap_in_use()

    def compile(self, job: Job) -> dict[str, Any]:
        """The answer to one job: the grammar and its bytes, or the 400 it deserves."""
        before = self._in_use()
        try:
            schema = load_constraint_schema(job)
            check_constraint(job.kind, job.value, schema, self.limits)
            grammar, schema = grammar_for(job)
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise library_error(job, matcher.get_error(), schema)
            self._probe(job, matcher, schema)
        except InvalidRequestError as error:
            return {"ok": False, "message": error.message, "code": error.code}
        except (ValueError, RecursionError, MemoryError) as error:  # the library's, for odd input
            message = f"invalid {job.kind} constraint: {str(error)[:300]}"
            return {"ok": False, "message": message, "code": None}
        after = self._in_use()
        size = after - before if after is not None and before is not None else len(grammar)
        return {"ok": True, "grammar": grammar, "bytes": max(size, len(grammar))}

    def _probe(self, job: Job, matcher: llguidance.LLMatcher, schema: Any) -> None:
        """The first mask, then up to PROBE_TOKENS random allowed tokens (seeded): a grammar
        that allows no first token, or that the library gives up on along the way, is refused
        here rather than failing a request halfway through its output."""
        mask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        pick = random.Random(0)
        for step in range(PROBE_TOKENS + 1):
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            if matcher.is_error():
                raise self._failure(job, matcher, schema, step)
            bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: self.vocab_size]
            allowed = np.flatnonzero(bits)
            if allowed.size == 0:
                if step == 0:
                    raise library_error(job, "no token can start an output that matches", schema)
                raise dead_end(job.kind, step)
            if step == PROBE_TOKENS:
                return
            if not matcher.consume_token(int(allowed[pick.randrange(allowed.size)])):
                raise self._failure(job, matcher, schema, step)
            if matcher.is_stopped():
                if not matcher.is_accepting():  # no further token, and not complete
                    raise dead_end(job.kind, step + 1)
                return

    def _failure(
        self, job: Job, matcher: llguidance.LLMatcher, schema: Any, step: int
    ) -> InvalidRequestError:
        kind = failure_kind(matcher)
        if kind == "dead_end":
            return dead_end(job.kind, step)
        if kind == "too_complex":
            first = matcher.get_error().strip().splitlines()[0][:300]
            return InvalidRequestError(
                f"the {job.kind} constraint is too complex for the grammar library after "
                f"{step} tokens: {first}",
                code=GRAMMAR_TOO_COMPLEX,
            )
        return library_error(job, matcher.get_error(), schema)


def dead_end(kind: str, tokens: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"the {kind} constraint allows no token after {tokens} tokens of output",
        code="grammar_dead_end",
    )


def _die_with(parent: int) -> None:
    """SIGKILL when the engine dies (even by SIGKILL or the OOM killer)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit("the engine is gone")


def _limit_memory(extra_bytes: int) -> None:
    """Address space: what the worker maps now, plus `extra_bytes` for one compile. A grammar
    past it makes the library's allocation fail, which aborts this process, not the engine."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _serve(stdin: Any, stdout: Any) -> None:
    init = read_message(stdin)
    if init is None:
        return
    # Absolute, not a further step: it inherits its spawning thread's niceness.
    os.setpriority(os.PRIO_PROCESS, 0, init["nice"])
    compiler = Compiler(init)
    # A first compile does the library's one-time work (tables over the vocabulary), so that
    # what later compiles measure is their grammar's alone.
    compiler.compile(Job("regex", "warm"))
    _limit_memory(init["memory_bytes"])
    write_message(stdout, {"ready": True})
    trim = _malloc_trim()
    while (job := read_message(stdin)) is not None:
        write_message(stdout, compiler.compile(Job(job["kind"], job["value"])))
        trim()  # a large grammar's memory goes back to the system, not to the worker's heap


def main() -> int:
    _die_with(int(sys.argv[1]))
    stack_bytes = int(sys.argv[2])
    # The compile runs on a thread whose stack is set here: the engine builds what passed on a
    # thread with a larger one (engine.structured.workers.ENGINE_STACK_FACTOR).
    threading.stack_size(stack_bytes)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the message stream
    thread = threading.Thread(target=_serve, args=(stdin, stdout), name="compile")
    thread.start()
    thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
