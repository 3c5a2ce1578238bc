"""The random source of one structured case: its ``random.Random`` and how large its sizes may
get. Every size comes from a ladder of up to five rungs, small to pathological; low rungs are
drawn most, and ``max_rung`` caps them (the tier-1 test stays on the low ones)."""

from __future__ import annotations

import random
from dataclasses import dataclass

RUNG_WEIGHTS = (12, 6, 3, 1.5, 1)  # about one size in ten from the top two rungs
TOP_RUNG = len(RUNG_WEIGHTS) - 1


@dataclass
class Draw:
    rng: random.Random
    max_rung: int = TOP_RUNG

    def size(self, ladder: tuple[int, ...]) -> int:
        rungs = range(min(len(ladder), self.max_rung + 1))
        return ladder[self.rng.choices(rungs, RUNG_WEIGHTS[: len(rungs)])[0]]
