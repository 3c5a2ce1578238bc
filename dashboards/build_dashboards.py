"""Generate the Grafana dashboards (JSON) from one compact panel list per dashboard.

Run `python dashboards/build_dashboards.py` after editing; the JSON files are committed so that
Grafana's file provisioning (dashboards/provisioning/) can load them as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# (title, unit, [(legend, expr), ...]) per panel; laid out two per row.
Panel = tuple[str, str, list[tuple[str, str]]]

ENGINE_PANELS: list[Panel] = [
    (
        "Requests running / waiting",
        "short",
        [
            (
                "running {{model_name}}",
                'sum by (model_name) (vllm:num_requests_running{model_name=~"$model"})',
            ),
            (
                "waiting {{model_name}}",
                'sum by (model_name) (vllm:num_requests_waiting{model_name=~"$model"})',
            ),
        ],
    ),
    (
        "KV cache usage",
        "percentunit",
        [
            ("{{model_name}} {{instance}}", 'vllm:kv_cache_usage_perc{model_name=~"$model"}'),
        ],
    ),
    (
        "Token throughput",
        "short",
        [
            (
                "prompt tok/s {{model_name}}",
                'sum by (model_name) (rate(vllm:prompt_tokens_total{model_name=~"$model"}[$__rate_interval]))',
            ),
            (
                "generated tok/s {{model_name}}",
                'sum by (model_name) (rate(vllm:generation_tokens_total{model_name=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    (
        "Finished requests / s",
        "reqps",
        [
            (
                "{{finished_reason}} {{model_name}}",
                'sum by (model_name, finished_reason) (rate(vllm:request_success_total{model_name=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    (
        "Time to first token",
        "s",
        [
            (
                "p50 {{model_name}}",
                'histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket{model_name=~"$model"}[$__rate_interval])))',
            ),
            (
                "p99 {{model_name}}",
                'histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket{model_name=~"$model"}[$__rate_interval])))',
            ),
        ],
    ),
    (
        "Inter-token latency",
        "s",
        [
            (
                "p50 {{model_name}}",
                'histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:inter_token_latency_seconds_bucket{model_name=~"$model"}[$__rate_interval])))',
            ),
            (
                "p99 {{model_name}}",
                'histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:inter_token_latency_seconds_bucket{model_name=~"$model"}[$__rate_interval])))',
            ),
        ],
    ),
    (
        "End-to-end request latency",
        "s",
        [
            (
                "p50 {{model_name}}",
                'histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:e2e_request_latency_seconds_bucket{model_name=~"$model"}[$__rate_interval])))',
            ),
            (
                "p99 {{model_name}}",
                'histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:e2e_request_latency_seconds_bucket{model_name=~"$model"}[$__rate_interval])))',
            ),
        ],
    ),
    (
        "Queue time",
        "s",
        [
            (
                "p50 {{model_name}}",
                'histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:request_queue_time_seconds_bucket{model_name=~"$model"}[$__rate_interval])))',
            ),
            (
                "p99 {{model_name}}",
                'histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:request_queue_time_seconds_bucket{model_name=~"$model"}[$__rate_interval])))',
            ),
        ],
    ),
    (
        "Prefix cache hit rate",
        "percentunit",
        [
            (
                "{{model_name}}",
                'sum by (model_name) (rate(vllm:prefix_cache_hits_total{model_name=~"$model"}[$__rate_interval])) / clamp_min(sum by (model_name) (rate(vllm:prefix_cache_queries_total{model_name=~"$model"}[$__rate_interval])), 1)',
            ),
        ],
    ),
    (
        "Preemptions / s",
        "short",
        [
            (
                "{{model_name}}",
                'sum by (model_name) (rate(vllm:num_preemptions_total{model_name=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
]

GATEWAY_PANELS: list[Panel] = [
    (
        "Requests / s by status",
        "reqps",
        [
            (
                "{{code}} {{model}}",
                'sum by (model, code) (rate(modelyard_requests_total{model=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    (
        "Error ratio (5xx)",
        "percentunit",
        [
            (
                "{{model}}",
                # "or 0 * ...": 0 rather than no data while there is no 5xx series at all.
                'sum by (model) (rate(modelyard_requests_total{model=~"$model", code=~"5.."}[$__rate_interval]) or 0 * rate(modelyard_requests_total{model=~"$model"}[$__rate_interval])) / clamp_min(sum by (model) (rate(modelyard_requests_total{model=~"$model"}[$__rate_interval])), 1e-9)',
            ),
        ],
    ),
    (
        "Request duration",
        "s",
        [
            (
                "p50 {{model}}",
                'histogram_quantile(0.5, sum by (le, model) (rate(modelyard_request_duration_seconds_bucket{model=~"$model"}[$__rate_interval])))',
            ),
            (
                "p99 {{model}}",
                'histogram_quantile(0.99, sum by (le, model) (rate(modelyard_request_duration_seconds_bucket{model=~"$model"}[$__rate_interval])))',
            ),
        ],
    ),
    (
        "Time to first token (through the gateway)",
        "s",
        [
            (
                "p50 {{model}}",
                'histogram_quantile(0.5, sum by (le, model) (rate(modelyard_time_to_first_token_seconds_bucket{model=~"$model"}[$__rate_interval])))',
            ),
            (
                "p99 {{model}}",
                'histogram_quantile(0.99, sum by (le, model) (rate(modelyard_time_to_first_token_seconds_bucket{model=~"$model"}[$__rate_interval])))',
            ),
        ],
    ),
    (
        "In-flight requests",
        "short",
        [
            ("{{model}}", 'sum by (model) (modelyard_requests_in_flight{model=~"$model"})'),
        ],
    ),
    (
        "Backends up / ejected",
        "short",
        [
            ("up {{model}} {{backend}}", 'modelyard_backend_up{model=~"$model"}'),
            ("ejected {{model}} {{backend}}", 'modelyard_backend_ejected{model=~"$model"}'),
        ],
    ),
    (
        "Upstream latency p99 by backend",
        "s",
        [
            (
                "{{backend}}",
                'histogram_quantile(0.99, sum by (le, backend) (rate(modelyard_upstream_latency_seconds_bucket{model=~"$model"}[$__rate_interval])))',
            ),
        ],
    ),
    (
        "Ejections, retries, timeouts / s",
        "short",
        [
            (
                "ejections {{backend}}",
                'sum by (backend) (rate(modelyard_ejections_total{model=~"$model"}[$__rate_interval]))',
            ),
            (
                "retries {{reason}}",
                'sum by (reason) (rate(modelyard_retries_total{model=~"$model"}[$__rate_interval]))',
            ),
            (
                "timeouts {{kind}}",
                'sum by (kind) (rate(modelyard_timeouts_total{model=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    (
        "Rate-limited requests / s",
        "reqps",
        [
            (
                "{{limit}} {{model}}",
                'sum by (model, limit) (rate(modelyard_rate_limited_total{model=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    (
        "Tokens / s",
        "short",
        [
            (
                "prompt {{model}}",
                'sum by (model) (rate(modelyard_prompt_tokens_total{model=~"$model"}[$__rate_interval]))',
            ),
            (
                "completion {{model}}",
                'sum by (model) (rate(modelyard_completion_tokens_total{model=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    # Admission (gateway/admission): each model's line, for a free slot or for a replica to come
    # (a load, a wake, a restart), and how fairly each key is served.
    (
        "Waiting in line (by band) and refusals",
        "short",
        [
            (
                "waiting {{model}} band {{band}}",
                'sum by (model, band) (modelyard_admission_queue_depth{model=~"$model"})',
            ),
            (
                "refused / s {{reason}}",
                'sum by (reason) (rate(modelyard_admission_refused_total{model=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    (
        "Wait in line by key (p50, p99)",
        "s",
        [
            (
                "p50 {{key}}",
                'histogram_quantile(0.5, sum by (le, key) (rate(modelyard_admission_wait_seconds_bucket{model=~"$model"}[$__rate_interval])))',
            ),
            (
                "p99 {{key}}",
                'histogram_quantile(0.99, sum by (le, key) (rate(modelyard_admission_wait_seconds_bucket{model=~"$model"}[$__rate_interval])))',
            ),
        ],
    ),
    (
        "Tokens served / s by key (divide by its weight: equal within a band when all are busy)",
        "short",
        [
            (
                "{{key}}",
                'sum by (key) (rate(modelyard_admission_charged_tokens_total{model=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    (
        "Shed requests / s by key",
        "reqps",
        [
            (
                "{{key}} {{model}}",
                'sum by (model, key) (rate(modelyard_admission_shed_total{model=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    # Residency (gateway/residency): what is loaded and what it costs to bring a model up (the
    # requests waiting meanwhile are in the line, above).
    (
        "Replicas by state",
        "short",
        [
            (
                "{{model}} {{state}}",
                'sum by (model, state) (modelyard_replica_state{model=~"$model"})',
            ),
        ],
    ),
    (
        "Load and wake time (p95)",
        "s",
        [
            (
                "{{kind}} {{model}}",
                'histogram_quantile(0.95, sum by (le, model, kind) (rate(modelyard_model_load_seconds_bucket{model=~"$model"}[$__rate_interval])))',
            ),
        ],
    ),
    (
        "Poison requests / s",
        "short",
        [
            (
                "{{result}} {{model}}",
                'sum by (model, result) (rate(modelyard_poison_requests_total{model=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    (
        "Evictions / s",
        "short",
        [
            (
                "{{action}} {{reason}} {{model}}",
                'sum by (model, action, reason) (rate(modelyard_model_evictions_total{model=~"$model"}[$__rate_interval]))',
            ),
        ],
    ),
    (
        "Memory budget",
        "bytes",
        [
            ("budget", "max(modelyard_memory_budget_bytes)"),
            ("resident", "max(modelyard_memory_resident_bytes)"),
            (
                "{{kind}} {{model}}",
                'max by (model, kind) (modelyard_model_footprint_bytes{model=~"$model"})',
            ),
        ],
    ),
]


def dashboard(
    uid: str, title: str, panels: list[Panel], model_label: str, probe_metric: str
) -> dict:
    """A Grafana dashboard with a datasource picker and a multi-select model variable."""
    grafana_panels = []
    for index, (panel_title, unit, targets) in enumerate(panels):
        grafana_panels.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": panel_title,
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {
                        "refId": chr(ord("A") + i),
                        "expr": expr,
                        "legendFormat": legend,
                        "datasource": DATASOURCE,
                    }
                    for i, (legend, expr) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": uid,
        "title": title,
        "tags": ["modelyard"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                },
                {
                    "name": "model",
                    "type": "query",
                    "label": "Model",
                    "datasource": DATASOURCE,
                    "query": f"label_values({probe_metric}, {model_label})",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": grafana_panels,
    }


DASHBOARDS = {
    "modelyard-engine.json": dashboard(
        "modelyard-engine",
        "Modelyard / Engines",
        ENGINE_PANELS,
        "model_name",
        "vllm:num_requests_running",
    ),
    "modelyard-gateway.json": dashboard(
        "modelyard-gateway",
        "Modelyard / Gateway",
        GATEWAY_PANELS,
        "model",
        "modelyard_requests_total",
    ),
}


def main() -> None:
    for name, board in DASHBOARDS.items():
        (HERE / name).write_text(json.dumps(board, indent=2) + "\n")
        print(f"wrote dashboards/{name}")


if __name__ == "__main__":
    main()
