"""One request's latencies as its outputs reach the event loop, reported to the engine's metrics
(engine.serving.metrics: queue time, time to first token, inter-token latency, end to end by
finish reason)."""

from __future__ import annotations

from engine.core.sequence import RequestOutput
from engine.serving.metrics import EngineMetrics


class RequestStats:
    def __init__(self, metrics: EngineMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival  # time.monotonic() when the server accepted it
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_reasons: dict[int, str] = {}

    def observe(self, out: RequestOutput, now: float) -> None:
        if out.queue_time_s is not None:
            self.metrics.observe_queue_time(out.queue_time_s)
        if any(c.token_ids for c in out.outputs):
            if self.first_token_time is None:
                self.first_token_time = now
                self.metrics.observe_first_token(now - self.arrival)
            else:
                self.metrics.observe_inter_token(now - (self.last_token_time or now))
            self.last_token_time = now
        for choice in out.outputs:
            if choice.finish_reason is not None:
                self.finish_reasons[choice.index] = choice.finish_reason
        if out.finished:
            reason = self.finish_reasons.get(0) or next(iter(self.finish_reasons.values()))
            self.metrics.observe_finished(reason, now - self.arrival)

    def aborted(self, now: float) -> None:
        """It ended before finishing: the client left, the server shut down or the core refused
        it mid-output."""
        self.metrics.observe_finished("abort", now - self.arrival)
