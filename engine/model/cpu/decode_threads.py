"""How many threads a decode step runs on: all the engine's, or one, whichever ran faster lately.

A decode step syncs its team at every layer's barriers (kernels/spin_barrier.h: about 160 a step
for Gemma 3 270M). On cores of its own, two threads run that step in 9 ms where one takes 12.
When anything else runs on the host (another engine, a grammar compile, a build), a thread
arrives at each barrier while its partner is descheduled, and waits out the partner's time
slice: measured, 55 ms a step on two threads beside one busy process, against 12 on one thread
(docs/PERFORMANCE.md#decode-threads-under-contention). No signal from the kernel says cheaply
which count is faster now, so each size of decode step keeps the recent step time of both,
runs the faster, and runs the other every `PROBE_EVERY`-th step, so that a change on the host
(an engine starting or going idle) turns the choice within a second or so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# One step in this many runs the count that is slower lately, to see whether it still is: on an
# idle host a one-thread probe costs a 64th of a third more, 0.5 % of decode throughput.
PROBE_EVERY = 64
# Weight of a new step time in its count's running average: the count in use is timed every
# step, so a host getting busy shows within a few; a probe is the only recent time of the other
# count, so it weighs more.
IN_USE_WEIGHT = 0.25
PROBE_WEIGHT = 0.75


@dataclass
class _Times:
    """Recent seconds per step of one size of decode step, by thread count."""

    seconds: dict[int, float] = field(default_factory=dict)
    steps: int = 0

    def faster(self, counts: tuple[int, int]) -> int:
        return min(counts, key=lambda n: self.seconds[n])


class DecodeThreads:
    """The thread count of each decode step of an engine configured for ``threads`` threads:
    `choose` before the step, `observe` its time after."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._counts = (threads, 1)
        self._sizes: dict[int, _Times] = {}  # by the batch's power of two

    def choose(self, rows: int) -> int:
        """The thread count of the next decode step of ``rows`` sequences."""
        if self.threads <= 1:
            return self.threads
        times = self._sizes.setdefault(rows.bit_length(), _Times())
        unmeasured = [n for n in self._counts if n not in times.seconds]
        if unmeasured:
            return unmeasured[0]
        times.steps += 1
        faster = times.faster(self._counts)
        return faster if times.steps % PROBE_EVERY else self._other(faster)

    def observe(self, rows: int, threads: int, seconds: float) -> None:
        """A decode step of ``rows`` sequences took ``seconds`` on ``threads`` threads."""
        times = self._sizes.get(rows.bit_length())
        if times is None or threads not in self._counts:
            return
        last = times.seconds.get(threads)
        if last is None:
            times.seconds[threads] = seconds
            return
        other = times.seconds.get(self._other(threads))
        in_use = other is None or last <= other
        weight = IN_USE_WEIGHT if in_use else PROBE_WEIGHT
        times.seconds[threads] = last + weight * (seconds - last)

    def _other(self, threads: int) -> int:
        return self._counts[1] if threads == self._counts[0] else self._counts[0]
