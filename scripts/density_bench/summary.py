"""The figures bench_density leads with, from each side's raw record: copies awake at once,
round latency p50/p99, memory held (PSS and RSS summed) awake and, for Modelyard, parked; and
Modelyard's ratios to llama-server. Pure functions of their inputs."""

from __future__ import annotations

from typing import Any


def _round(side: dict[str, Any]) -> dict[str, Any]:
    r = side.get("round") or {}
    e2e = r.get("e2e_s") or {}
    return {
        "latency_p50_s": e2e.get("p50"),
        "latency_p99_s": e2e.get("p99"),
        "ttft_p50_s": (r.get("ttft_s") or {}).get("p50"),
        "completed": r.get("completed"),
        "errors": r.get("errors"),
        "unfinished_at_deadline": r.get("unfinished_at_deadline"),
    }


def _state(memory: dict[str, Any] | None, state: str) -> dict[str, int]:
    return ((memory or {}).get("totals") or {}).get(state) or {}


def modelyard_summary(side: dict[str, Any]) -> dict[str, Any]:
    fill = side.get("fill") or {}
    awake = _state(side.get("memory_awake"), "ready")
    parked = _state(side.get("memory_after_park"), "parked")
    return {
        "awake": fill.get("awake_max"),
        "stopped_because": fill.get("stopped_because"),
        **_round(side),
        "awake_pss_bytes": awake.get("pss_bytes"),
        "awake_rss_bytes": awake.get("rss_bytes"),
        "parked_copies_after_park": parked.get("copies"),
        "parked_pss_bytes": parked.get("pss_bytes"),
        "parked_rss_bytes": parked.get("rss_bytes"),
        "error": side.get("error"),
    }


def llama_summary(side: dict[str, Any]) -> dict[str, Any]:
    fill = side.get("fill") or {}
    totals = side.get("totals") or {}
    return {
        "awake": fill.get("count"),
        "stopped_because": fill.get("stopped_because"),
        **_round(side),
        "awake_pss_bytes": totals.get("pss_bytes"),
        "awake_rss_bytes": totals.get("rss_bytes"),
        "error": side.get("error"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summarize(modelyard: dict[str, Any] | None, llama: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if modelyard is not None:
        out["modelyard"] = modelyard_summary(modelyard)
    if llama is not None:
        out["llama"] = llama_summary(llama)
    if modelyard is not None and llama is not None:
        my, ll = out["modelyard"], out["llama"]
        out["modelyard_over_llama"] = {
            k: _ratio(my[k], ll[k])
            for k in ("awake", "latency_p50_s", "latency_p99_s", "awake_pss_bytes")
        }
    return out
