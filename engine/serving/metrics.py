"""Prometheus metrics under vLLM's names, so vLLM dashboards and endpoint pickers work unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# From 1 ms (GPU decode steps) to minutes (a loaded CPU box), roughly x2 per bucket.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")
# How a grammar can end a request mid-output (engine/core/engine_core.py): zeros exported for both
GRAMMAR_FAILURES = ("grammar_dead_end", "grammar_too_complex")


class _StatsCollector(Collector):
    """Gauges and cumulative counters read from the latest EngineCore.stats() snapshot at scrape
    time (the core already keeps the cumulative counts, so they are exported, not re-counted),
    and the memory footprint (EngineCore.footprint()) under modelyard_engine_* names (vLLM has
    none for them)."""

    def __init__(
        self,
        model_name: str,
        snapshot: Callable[[], Any],
        extra_waiting: Callable[[], int],
        footprint: Callable[[], Any],
        grammars: Callable[[], Any],
    ):
        self._model_name = model_name
        self._snapshot = snapshot
        self._extra_waiting = extra_waiting
        self._footprint = footprint
        self._grammars = grammars

    def collect(self) -> Iterator[Metric]:
        yield from self._footprint_gauges()
        yield from self._grammar_metrics()
        stats = self._snapshot()
        if stats is None:  # model still loading: nothing meaningful to export yet
            return
        failures = CounterMetricFamily(
            "modelyard_engine_structured_output_failures",
            "Requests a grammar ended mid-output with a 400, by error code.",
            labels=["model_name", "code"],
        )
        for code in sorted({*GRAMMAR_FAILURES, *stats.grammar_failures}):
            failures.add_metric([self._model_name, code], stats.grammar_failures.get(code, 0))
        yield failures
        label = [self._model_name]
        gauges = [
            (
                "vllm:num_requests_running",
                "Requests in model execution batches.",
                stats.num_running,
            ),
            (
                "vllm:num_requests_waiting",
                "Requests waiting to be processed.",
                stats.num_waiting + self._extra_waiting(),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                stats.kv_cache_usage,
            ),
        ]
        counters = [
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hits,
            ),
            ("vllm:num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                stats.generation_tokens,
            ),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, float(value))
            yield gauge
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, float(value))
            yield counter

    def _grammar_metrics(self) -> Iterator[Metric]:
        grammars = self._grammars()
        if grammars is None:  # loading, or a core without structured outputs
            return
        gauges = [
            ("modelyard_engine_structured_cache_bytes",
             "Grammar bytes cached or in use (as measured at compile).", grammars.cache_bytes),
            ("modelyard_engine_structured_cache_budget_bytes",
             "The grammar memory budget (--structured-cache-memory).",
             grammars.cache_budget_bytes),
            ("modelyard_engine_compile_workers_rss_bytes",
             "Resident memory of the grammar-compile worker processes.",
             grammars.workers_rss_bytes),
        ]  # fmt: skip
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self._model_name], float(value))
            yield gauge
        compiles = CounterMetricFamily(
            "modelyard_engine_structured_compiles",
            "Constraint compiles by outcome: ok, a refusal's code (invalid: code null), cancelled.",
            labels=["model_name", "outcome"],
        )
        for outcome, count in sorted(grammars.compiles.items()):
            compiles.add_metric([self._model_name, outcome], count)
        yield compiles

    def _footprint_gauges(self) -> Iterator[Metric]:
        footprint = self._footprint()
        if footprint is None:  # loading, or a core that does not measure it
            return
        gauges = [
            ("modelyard_engine_sleeping", "1 while the engine sleeps.", footprint.sleeping),
            (
                "modelyard_engine_weights_bytes",
                "Weight bytes in process memory.",
                footprint.weights_bytes,
            ),
            (
                "modelyard_engine_kv_cache_bytes",
                "KV cache pool bytes.",
                footprint.kv_cache_bytes,
            ),
            (
                "modelyard_engine_last_wake_seconds",
                "Duration of the latest wake from sleep (0 before the first).",
                footprint.park.last_wake_s or 0.0,
            ),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self._model_name], float(value))
            yield gauge


class EngineMetrics:
    """One engine's metrics in a private registry (several apps can live in one test process)."""

    def __init__(
        self,
        model_name: str,
        snapshot: Callable[[], Any],
        extra_waiting: Callable[[], int] = lambda: 0,
        *,
        footprint: Callable[[], Any],
        grammars: Callable[[], Any] = lambda: None,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(
            _StatsCollector(model_name, snapshot, extra_waiting, footprint, grammars)
        )
        labels = ["model_name"]

        def histogram(name: str, doc: str) -> Histogram:
            hist = Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)
            return hist.labels(model_name)

        self._ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self._itl = histogram("vllm:inter_token_latency_seconds", "Latency between tokens.")
        self._e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self._queue = histogram("vllm:request_queue_time_seconds", "Time spent waiting in queue.")
        self._success = Counter(
            "vllm:request_success",
            "Count of finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:  # export zeros so rate() works from the first scrape
            self._success.labels(model_name, reason)

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_queue_time(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def observe_finished(self, reason: str, e2e_seconds: float) -> None:
        self._success.labels(self.model_name, reason).inc()
        self._e2e.observe(e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
