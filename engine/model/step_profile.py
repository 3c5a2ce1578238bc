"""Where a step's time goes: wall time per named span, summed over the steps run while profiling
is on (`StepProfile.enabled`; off, nothing is timed). One profile per engine, owned by the runner
(`ModelRunner.profile`, also `EngineCore.profile`); it lives in model/ because model/ code records
spans too and may not import core/.

Spans are paths; a child's time is part of its parent's:

    schedule                    Scheduler.schedule
    batch                       SchedulerOutput.to_step_batch
    forward                     ModelRunner.execute: block copies, metadata, the model's forward
    forward/attention           every layer's attention call (StepContext); on narrow weights'
                                one-call decode steps, each layer's input norm, qkv GEMM and
                                attention, as the C kernel's thread 0 times them
    forward/attention/qkv_gemm  the qkv projection run inside a fused decode attention call (timed
                                by the C kernel up to its barrier: engine/model/cpu/kernels)
    sample                      Sampler
    postprocess                 detokenizing, update_from_output (appends, stop checks), deltas

The top-level spans follow each other without gaps: together they are the step's wall time. On
CUDA they are host time: attention synchronises the device while profiling, the others do not (a
forward's kernels may finish inside sample).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

SCHEDULE = "schedule"
BATCH = "batch"
FORWARD = "forward"
ATTENTION = "forward/attention"
QKV_IN_ATTENTION = "forward/attention/qkv_gemm"
SAMPLE = "sample"
POSTPROCESS = "postprocess"
# Every span in the order a step runs them (parents before their children).
SPANS = (SCHEDULE, BATCH, FORWARD, ATTENTION, QKV_IN_ATTENTION, SAMPLE, POSTPROCESS)


@dataclass
class Span:
    seconds: float = 0.0
    calls: int = 0  # calls booked one by one (attention: one per layer); 0 for the step's laps


class StepProfile:
    """Wall time per span of the steps profiled since the last `reset`."""

    def __init__(self) -> None:
        self.enabled = False
        self.reset()

    def reset(self) -> None:
        self.steps = 0  # steps whose spans were booked
        self.spans = {path: Span() for path in SPANS}

    def add(self, path: str, seconds: float) -> None:
        """Book one call of ``path`` that took ``seconds``."""
        span = self.spans[path]
        span.seconds += seconds
        span.calls += 1

    def laps(self) -> Laps:
        """A stopwatch for one step's top-level spans, started now; a no-op one when off."""
        return Laps(self) if self.enabled else _NO_LAPS

    # ------------------------------------------------------------------------- reading
    def seconds(self, path: str) -> float:
        return self.spans[path].seconds

    def calls(self, path: str) -> int:
        return self.spans[path].calls

    def children(self, path: str | None) -> list[str]:
        """The spans directly inside ``path`` (None: the top-level spans)."""
        depth = 0 if path is None else path.count("/") + 1
        prefix = "" if path is None else path + "/"
        return [p for p in SPANS if p.startswith(prefix) and p.count("/") == depth]

    def self_seconds(self, path: str) -> float:
        """``path``'s time outside its child spans."""
        return self.seconds(path) - sum(self.seconds(child) for child in self.children(path))

    def step_seconds(self) -> float:
        """All profiled steps' wall time (the top-level spans' sum)."""
        return sum(self.seconds(path) for path in self.children(None))

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per profiled step: ``step`` and every span."""
        steps = max(1, self.steps)
        figures = {"step": self.step_seconds() / steps * 1e3}
        figures.update({path: self.seconds(path) / steps * 1e3 for path in SPANS})
        return figures

    def report(self) -> str:
        """The spans as an indented table: ms per step, share of the step, calls per step (of
        spans booked call by call)."""
        steps = max(1, self.steps)
        step_s = self.step_seconds()
        lines = [
            f"{'span':<30} {'ms/step':>9} {'share':>6} {'calls/step':>10}",
            f"{'step':<30} {step_s / steps * 1e3:>9.3f} {self.steps:>6} steps",
        ]
        for path in SPANS:
            span = self.spans[path]
            name = "  " * (path.count("/") + 1) + path.rsplit("/", 1)[-1]
            share = span.seconds / step_s if step_s else 0.0
            calls = f"{span.calls / steps:>10.1f}" if span.calls else ""
            line = f"{name:<30} {span.seconds / steps * 1e3:>9.3f} {share:>6.1%} {calls}"
            lines.append(line.rstrip())
        return "\n".join(lines)


class Laps:
    """Books consecutive spans of one step: each `lap` the time since the previous one."""

    __slots__ = ("_last", "_profile")

    def __init__(self, profile: StepProfile | None) -> None:
        self._profile = profile
        self._last = time.perf_counter() if profile is not None else 0.0

    def lap(self, path: str) -> None:
        """Book the time since the previous lap (or the start) to ``path``."""
        if self._profile is not None:
            now = time.perf_counter()
            self._profile.spans[path].seconds += now - self._last
            self._last = now

    def end_step(self) -> None:
        """Count the step whose spans were booked."""
        if self._profile is not None:
            self._profile.steps += 1


_NO_LAPS = Laps(None)
