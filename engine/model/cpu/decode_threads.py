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

import statistics
from collections import deque
from dataclasses import dataclass, field

SLOWER = 1.25
PROBE_EVERY = 64
PROBE_AT_MOST = 256
# A count's step time is the median of its last RECENT steps: a step the event loop, a page fault
# or an interrupt held up does not turn the choice (one outlier in an average did, and put an
# idle engine on one thread for 64 steps). The team runs this many steps before one thread is
# first timed, its first step (cold caches) outvoted.
RECENT = 5


@dataclass
class _Times:
    """One size class of decode steps: recent seconds a step by thread count (the count in use
    timed every step, the other at its last probe), and when to time the count not in use."""

    recent: dict[int, deque[float]] = field(default_factory=dict)
    team_when_compared: float = 0.0  # the team's step time when one thread was last timed
    since_probe: int = 0  # steps on one thread since the team was last timed
    probe_every: int = PROBE_EVERY

    def seconds(self, threads: int) -> float | None:
        times = self.recent.get(threads)
        return statistics.median(times) if times else None

    def team_faster(self, team: int) -> bool | None:
        """Whether the team's recent steps are the faster (None: one count not yet timed)."""
        on_team, on_one = self.seconds(team), self.seconds(1)
        if on_team is None or on_one is None:
            return None
        return on_team <= on_one


class DecodeThreads:
    """The thread count of each decode step of an engine of ``threads`` threads: `choose`
    before the step, `observe` its time after."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._sizes: dict[int, _Times] = {}  # by the batch's power of two

    def choose(self, rows: int) -> int:
        """The thread count of the next decode step of ``rows`` sequences."""
        team = self.threads
        if team <= 1:
            return team
        times = self._sizes.setdefault(rows.bit_length(), _Times())
        faster = times.team_faster(team)
        if faster is None:  # the team for RECENT steps, then one thread once
            return team if len(times.recent.get(team, ())) < RECENT else 1
        if faster:
            return 1 if times.seconds(team) > SLOWER * times.team_when_compared else team
        times.since_probe += 1
        if times.since_probe < times.probe_every:
            return 1
        times.since_probe = 0
        times.probe_every = min(2 * times.probe_every, PROBE_AT_MOST)
        return team

    def observe(self, rows: int, threads: int, seconds: float) -> None:
        """A decode step of ``rows`` sequences took ``seconds`` on ``threads`` threads."""
        times = self._sizes.get(rows.bit_length())
        team = self.threads
        if times is None or threads not in (team, 1):
            return
        team_was_faster = times.team_faster(team)
        in_use = (threads == team) == (team_was_faster is not False)
        if in_use:
            times.recent.setdefault(threads, deque(maxlen=RECENT)).append(seconds)
        else:  # a probe: the only recent time of that count
            times.recent[threads] = deque([seconds], maxlen=RECENT)
        if threads == 1:
            times.team_when_compared = times.seconds(team) or 0.0
        if team_was_faster is False and times.team_faster(team):
            times.since_probe, times.probe_every = 0, PROBE_EVERY  # on the team again
