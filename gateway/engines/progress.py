"""A starting engine's load progress as the gateway sees it. The engine reports the start-up
stage it is in on ``GET /status`` (``startup``: engine/startup.py's phases, a percent where the
phase counts one, seconds in it) from the moment it listens; the pool polls it while the replica
is STARTING and logs a line per new stage, ``/admin/models`` shows it per replica, and a held
request's refusal names it (gateway/residency/manager.py)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

# The engine's first phase, which ends when it listens: until /status answers, it is in this one.
BEFORE_LISTENING = "imports and http server"
# What the engine reports while no phase runs: shown, but no stage worth a log line.
BETWEEN_PHASES = frozenset({"loading", "ready"})


@dataclass
class LoadProgress:
    stage: str = BEFORE_LISTENING
    percent: float | None = None  # where the stage counts one (the weights: tensors read)
    stage_since: float = field(default_factory=time.monotonic)  # on the gateway's clock

    def describe(self) -> dict[str, object]:
        return {
            "stage": self.stage,
            "percent": self.percent,
            "stage_s": round(time.monotonic() - self.stage_since, 3),
        }

    def __str__(self) -> str:
        percent = f" {self.percent:.0f}%" if self.percent is not None else ""
        return f"{self.stage}{percent} ({time.monotonic() - self.stage_since:.1f}s in it)"


def reported_progress(status: dict[str, Any] | None) -> LoadProgress | None:
    """The ``startup`` an engine's /status reports; None where it reports none (an older
    engine, one that does not answer yet, a malformed answer)."""
    startup = status.get("startup") if status else None
    if not isinstance(startup, dict) or not isinstance(startup.get("stage"), str):
        return None
    percent, stage_s = startup.get("percent"), startup.get("stage_s")
    if not _finite(percent):
        percent = None
    return LoadProgress(
        stage=startup["stage"][:100],
        percent=percent,
        stage_since=time.monotonic() - (stage_s if _finite(stage_s) and stage_s > 0 else 0.0),
    )


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
