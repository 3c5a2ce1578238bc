"""Prometheus metrics of the gateway, prefix ``modelyard_``.

Labels are bounded: ``model`` is a configured model name (``_unknown`` for names that resolve to
nothing), ``backend`` a configured backend's host:port, ``code`` an HTTP status, ``key`` a
configured API key's name (``_anonymous`` in open mode), ``band`` a configured key priority,
``limit``/``kind``/``reason`` small fixed sets. Never a request id or an API key's secret.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.backend import Backend, BackendState, Condition
from gateway.engines.replica import Replica, ReplicaState

UNKNOWN_MODEL = "_unknown"
# The fixed label values, exported as zeros up front (see declare_model).
RETRY_REASONS = (
    "connect",
    "connect_timeout",
    "disconnect",
    "status_502",
    "status_503",
    "ejected",
    "engine_crashed",
)
TIMEOUT_KINDS = ("connect", "first_byte", "idle", "total")
RATE_LIMITS = ("key_requests", "key_tokens", "model_requests", "model_tokens")
LIMIT_STORE_ERRORS = ("connection", "timeout", "response")  # gateway/limits/shared.py
ON_ERROR_POLICIES = ("allow", "deny", "local")
RELOAD_RESULTS = ("applied", "rejected")
# gateway/admission/refusals.py's codes, and the residency manager's refusals of a model's line
ADMISSION_REFUSALS = (
    "request_shed", "queue_full", "queue_timeout", "hold_queue_full", "model_loading_timeout",
    "model_failed", "model_unloaded",
)  # fmt: skip
POISON_RESULTS = ("suspect", "cleared", "marked", "refused")  # gateway/proxy/quarantine.py
LOAD_STATES = {ReplicaState.STARTING: "cold", ReplicaState.WAKING: "wake"}
EVICTIONS = tuple((a, r) for a in ("park", "stop") for r in ("idle", "memory", "operator"))
REPLICA_STATES = tuple(s.value for s in ReplicaState)
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "modelyard_requests",
            "Requests answered, by model and HTTP status",
            ["model", "code"],
            registry=r,
        )
        self.request_duration = Histogram(
            "modelyard_request_duration_seconds",
            "Time from request to the last byte sent",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "modelyard_time_to_first_token_seconds",
            "Streams: time from request to first chunk",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_latency = Histogram(
            "modelyard_upstream_latency_seconds",
            "Time to the upstream's response headers, by backend",
            ["model", "backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "modelyard_requests_in_flight", "Requests being proxied", ["model"], registry=r
        )
        self.backend_up = Gauge(
            "modelyard_backend_up",
            "1 when the backend takes traffic (healthy, not ejected/drained)",
            ["model", "backend"],
            registry=r,
        )
        self.backend_ejected = Gauge(
            "modelyard_backend_ejected",
            "1 while passive outlier detection ejects the backend",
            ["model", "backend"],
            registry=r,
        )
        self.ejections = Counter(
            "modelyard_ejections", "Passive outlier ejections", ["model", "backend"], registry=r
        )
        self.retries = Counter(
            "modelyard_retries",
            "Attempts retried on another replica",
            ["model", "reason"],
            registry=r,
        )
        self.rate_limited = Counter(
            "modelyard_rate_limited",
            "Requests refused with 429, by the limit that refused them",
            ["model", "limit"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "modelyard_prompt_tokens", "Prompt tokens (upstream usage)", ["model"], registry=r
        )
        self.completion_tokens = Counter(
            "modelyard_completion_tokens",
            "Completion tokens (upstream usage)",
            ["model"],
            registry=r,
        )
        self.timeouts = Counter(
            "modelyard_timeouts", "Upstream timeouts by kind", ["model", "kind"], registry=r
        )
        self._children: dict[tuple, Any] = {}
        self._declare_admission_metrics(r)
        self._declare_residency_metrics(r)
        self.config_reloads = Counter(
            "modelyard_config_reloads", "Config reloads by result", ["result"], registry=r
        )
        for result in RELOAD_RESULTS:
            self.config_reloads.labels(result)
        self._declare_limit_store_metrics(r)

    def _declare_limit_store_metrics(self, r: CollectorRegistry) -> None:
        """The rate limits' store (gateway/limits/): with gateway.state, the Redis every gateway
        shares, and the on_error policy's decisions while it does not answer."""
        self.rate_limit_store_up = Gauge(
            "modelyard_rate_limit_store_up",
            "1 while the rate limits' store answers (always, for limits kept in-process); 0 while "
            "gateway.state's Redis does not and its on_error policy decides",
            registry=r,
        )
        self.rate_limit_store_up.set(1)
        self.rate_limit_store_errors = Counter(
            "modelyard_rate_limit_store_errors",
            "Admissions, usage corrections and probes whose call to the shared rate-limit store "
            "(Redis) failed",
            ["kind"],
            registry=r,
        )
        self.rate_limit_fallbacks = Counter(
            "modelyard_rate_limit_fallbacks",
            "Requests that gateway.state.on_error decided because Redis did not answer",
            ["policy"],
            registry=r,
        )
        for kind in LIMIT_STORE_ERRORS:
            self.rate_limit_store_errors.labels(kind)
        for policy in ON_ERROR_POLICIES:
            self.rate_limit_fallbacks.labels(policy)

    def declare_model(self, model: str) -> None:
        """Exports a model's rare-event counters as zeros before their first event, so that a
        dashboard's rate() sees the first event, and a quiet series reads 0 rather than
        "no data" (which looks the same as a broken scrape)."""
        self.in_flight.labels(model)
        for reason in RETRY_REASONS:
            self.retries.labels(model, reason)
        for kind in TIMEOUT_KINDS:
            self.timeouts.labels(model, kind)
        for limit in RATE_LIMITS:
            self.rate_limited.labels(model, limit)

    def _declare_admission_metrics(self, r: CollectorRegistry) -> None:
        self.admission_depth = Gauge(
            "modelyard_admission_queue_depth",
            "Requests waiting in the model's line (for a free slot, or for a replica to come), "
            "by the priority band of their key",
            ["model", "band"],
            registry=r,
        )
        self.admission_wait = Histogram(
            "modelyard_admission_wait_seconds",
            "Time requests spent in their model's line, whatever came of it (0: admitted at once)",
            ["model", "key"],
            buckets=(0, *_LATENCY_BUCKETS),
            registry=r,
        )
        self.admission_refused = Counter(
            "modelyard_admission_refused",
            "Requests their model's line refused or dropped, by reason (request_shed: 429)",
            ["model", "reason"],
            registry=r,
        )
        self.admission_shed = Counter(
            "modelyard_admission_shed",
            "Sheddable requests refused or dropped from the line under overload, by key",
            ["model", "key"],
            registry=r,
        )
        self.admission_tokens = Counter(
            "modelyard_admission_charged_tokens",
            "Prompt and generated tokens served to each key (its fair share, once divided by its "
            "weight), counted when each request ends",
            ["model", "key"],
            registry=r,
        )

    def declare_admission(self, model: str, bands: set[int], keys: set[str]) -> None:
        """A model's line series, at zero before their first event (the wait histogram's come
        with the first request of each key: a histogram is many series)."""
        for band in bands:
            self.admission_depth.labels(model, str(band))
        for reason in ADMISSION_REFUSALS:
            self.admission_refused.labels(model, reason)
        for key in keys:
            self.admission_shed.labels(model, key)
            self.admission_tokens.labels(model, key)

    def _declare_residency_metrics(self, r: CollectorRegistry) -> None:
        self.replica_state = Gauge(
            "modelyard_replica_state",
            "1 for the state each local replica is in (gateway/engines/replica.py), 0 for the "
            "others",
            ["model", "replica", "state"],
            registry=r,
        )
        self.model_load = Histogram(
            "modelyard_model_load_seconds",
            "From a replica's start (cold) or wake request (wake) to its ready state",
            ["model", "kind"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "modelyard_model_evictions",
            "Models parked or stopped, by action and reason (idle, memory for another, operator)",
            ["model", "action", "reason"],
            registry=r,
        )
        self.memory_budget = Gauge(
            "modelyard_memory_budget_bytes", "Host memory all resident engines may use", registry=r
        )
        self.memory_resident = Gauge(
            "modelyard_memory_resident_bytes",
            "Host memory the resident engines take, as planned (measured where reported)",
            registry=r,
        )
        self.poison_requests = Counter(
            "modelyard_poison_requests",
            "Requests in flight when their engine crashed (suspect), and what came of them: "
            "answered later (cleared), crashed it again on probation (marked), refused unsent",
            ["model", "result"],
            registry=r,
        )
        self.model_memory = Gauge(
            "modelyard_model_footprint_bytes",
            "One replica's footprint, awake and parked (measured once reported, estimated before)",
            ["model", "kind"],
            registry=r,
        )

    def declare_residency(self, model: str) -> None:
        """A local model's residency series, at zero before their first event."""
        for kind in LOAD_STATES.values():  # a pinned model loads once: rate() must see it
            self.model_load.labels(model, kind)
        for action, reason in EVICTIONS:
            self.evictions.labels(model, action, reason)
        for result in POISON_RESULTS:
            self.poison_requests.labels(model, result)

    def replica_changed(self, replica: Replica, old: ReplicaState) -> None:
        """The pool's transition hook: the replica's state series (one at 1, the others at 0),
        and the time it took to come up when it just became ready (started or woken)."""
        index = str(replica.index)
        if replica.state is ReplicaState.READY and old in LOAD_STATES:
            self.model_load.labels(replica.model, LOAD_STATES[old]).observe(replica.left_after_s)
        if replica.state is ReplicaState.STOPPED:
            for state in REPLICA_STATES:
                with contextlib.suppress(KeyError):
                    self.replica_state.remove(replica.model, index, state)
            return
        for state in REPLICA_STATES:
            self.replica_state.labels(replica.model, index, state).set(
                1 if state == replica.state.value else 0
            )

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: the hot path skips prometheus_client's lock."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def backend_changed(self, backend: Backend, before: BackendState | None) -> None:
        """The router's backend state listener (gateway/backend.py): a new backend's series start
        (its ejection count at 0, as in declare_model), a transition updates them, an ejection
        counts, and a removed backend's series go."""
        labels = (backend.model, backend.label)
        if backend.removed:
            self._forget(labels)
            return
        if before is None:
            self.ejections.labels(*labels)
        elif backend.ejected and Condition.EJECTED not in before:
            self.ejections.labels(*labels).inc()
        self.backend_up.labels(*labels).set(1 if backend.available else 0)
        self.backend_ejected.labels(*labels).set(1 if backend.ejected else 0)

    def _forget(self, labels: tuple[str, str]) -> None:
        for key in [k for k in self._children if k[1] == labels]:
            del self._children[key]
        for metric in (
            self.backend_up,
            self.backend_ejected,
            self.ejections,
            self.upstream_latency,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
