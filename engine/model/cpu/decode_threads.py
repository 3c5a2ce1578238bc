"""How many threads a decode step runs on: all the engine's (its team), or one, whichever ran
faster lately.

A decode step syncs its team at every layer's barriers (kernels/spin_barrier.h: about 160 a step
for Gemma 3 270M). On cores of its own, two threads run that step in 9 ms where one takes 12.
When anything else runs on the host (another engine, a grammar compile, a build), a thread
arrives at each barrier while its partner is descheduled, and waits out the partner's time
slice: measured, 55 ms a step on two threads beside one busy process, against 12 on one thread
(docs/PERFORMANCE.md#decode-threads-under-contention). No signal from the kernel says cheaply
which count is faster now, so each size class of decode step keeps the recent step time of both
and runs the faster:

- on the team, one thread is timed again only once the team's steps take `SLOWER` times what
  they took when one thread was last timed (the host got busy, or the context grew): an idle
  host runs every step on the team;
- on one thread, the team is timed again every `PROBE_EVERY` steps, twice as long after each
  time it is still slower, up to `PROBE_AT_MOST` (a step on the team costs a busy host ~4 steps
  on one), as nothing in one thread's own step times shows the host turning idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SLOWER = 1.25
PROBE_EVERY = 64
PROBE_AT_MOST = 256
# Weight of a new step time in the running average of the count in use, timed every step: a
# host getting busy shows within a step or two. The other count's time is its last probe's, the
# only recent one.
IN_USE_WEIGHT = 0.25


@dataclass
class _Times:
    """One size class of decode steps: recent seconds a step by thread count, and when to time
    the count not in use."""

    seconds: dict[int, float] = field(default_factory=dict)
    team_when_compared: float = 0.0  # the team's step time when one thread was last timed
    since_probe: int = 0  # steps on one thread since the team was last timed
    probe_every: int = PROBE_EVERY


class DecodeThreads:
    """The thread count of each decode step of an engine of ``threads`` threads: `choose`
    before the step, `observe` its time after."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._sizes: dict[int, _Times] = {}  # by the batch's power of two

    def choose(self, rows: int) -> int:
        """The thread count of the next decode step of ``rows`` sequences."""
        if self.threads <= 1:
            return self.threads
        times = self._sizes.setdefault(rows.bit_length(), _Times())
        team, seconds = self.threads, times.seconds
        if team not in seconds or 1 not in seconds:
            return team if team not in seconds else 1
        if seconds[team] <= seconds[1]:
            return 1 if seconds[team] > SLOWER * times.team_when_compared else team
        times.since_probe += 1
        if times.since_probe < times.probe_every:
            return 1
        times.since_probe = 0
        times.probe_every = min(2 * times.probe_every, PROBE_AT_MOST)
        return team

    def observe(self, rows: int, threads: int, seconds: float) -> None:
        """A decode step of ``rows`` sequences took ``seconds`` on ``threads`` threads."""
        times = self._sizes.get(rows.bit_length())
        if times is None or threads not in (self.threads, 1):
            return
        team, last = self.threads, times.seconds
        team_was_faster = team in last and 1 in last and last[team] <= last[1]
        in_use = (threads == team) == team_was_faster
        if in_use and threads in last:
            last[threads] += IN_USE_WEIGHT * (seconds - last[threads])
        else:
            last[threads] = seconds
        if threads == 1 and team in last:
            times.team_when_compared = last[team]
        if team in last and 1 in last and last[team] <= last[1] and not team_was_faster:
            times.since_probe, times.probe_every = 0, PROBE_EVERY  # on the team again
