"""The figures a run reports, from what it recorded: per-policy request summaries, deltas of the
gateway's residency metrics, the memory budget chosen from measured footprints, and the ratios
against their goals. Pure functions of their inputs."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from scripts.measure import percentile

MiB = 2**20
DEFAULT_PARKED_FLOOR = 600 * MiB  # when no model could be parked to measure one
GOALS = {
    "park_wake_p99_over_all_resident_p99_max": 2.0,
    "cold_swap_p99_over_park_wake_p99_min": 3.0,
    "wake_ttft_s_max": 1.0,
}

# (sample name, sorted label pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class RequestRecord:
    index: int
    model: str
    client: int
    start_s: float  # from the start of the stream
    latency_s: float | None = None
    ttft_s: float | None = None
    status: int | None = None  # HTTP status; None: no answer (connection error, timeout)
    chunks: int = 0  # content chunks streamed
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("start_s", "latency_s", "ttft_s"):
            if out[key] is not None:
                out[key] = round(out[key], 4)
        return out


def _stats(values: list[float]) -> dict[str, float | None]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "p50": r(percentile(values, 50)),
        "p99": r(percentile(values, 99)),
        "mean": r(statistics.fmean(values)) if values else None,
        "max": r(max(values)) if values else None,
    }


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Requests/s counts answered requests over the stream's wall time; latency and TTFT are of
    answered requests only, errors counted apart."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    per_model: dict[str, Any] = {}
    for model in sorted({r.model for r in records}):
        mine = [r for r in records if r.model == model]
        ok = [r for r in mine if r.ok]
        per_model[model] = {
            "requests": len(mine),
            "errors": len(mine) - len(ok),
            "latency_s": _stats([r.latency_s for r in ok if r.latency_s is not None]),
            "ttft_s": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        }
    return {
        "requests": len(records),
        "completed": len(done),
        "errors": len(failed),
        "error_samples": sorted({f"{r.status}: {r.error}" for r in failed})[:5],
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(done) / duration_s, 4) if duration_s > 0 else 0.0,
        "latency_s": _stats([r.latency_s for r in done if r.latency_s is not None]),
        "ttft_s": _stats([r.ttft_s for r in done if r.ttft_s is not None]),
        "per_model": per_model,
    }


# ---- the gateway's metrics -------------------------------------------------------------------


def parse_metrics(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def grouped(before: Samples, after: Samples, name: str, by: tuple[str, ...]) -> dict[str, float]:
    """``after - before`` of every ``name`` sample, summed by the labels in ``by`` (keys joined
    with '/'), non-zero groups only."""
    out: dict[str, float] = {}
    for (sample, labels), value in after.items():
        if sample != name:
            continue
        delta = value - before.get((sample, labels), 0.0)
        if abs(delta) < 1e-12:
            continue
        label = dict(labels)
        key = "/".join(label.get(k, "") for k in by)
        out[key] = round(out.get(key, 0.0) + delta, 4)
    return out


def swaps(before: Samples, after: Samples) -> dict[str, Any]:
    """What the gateway did between two scrapes: evictions by action and reason (and per model),
    engine loads by kind (cold start, wake) with their summed seconds, and held requests: those
    that waited in their model's line (for a load, or for a free slot), not admitted at once."""
    evictions = grouped(before, after, "modelyard_model_evictions_total", ("action",))
    loads = grouped(before, after, "modelyard_model_load_seconds_count", ("kind",))
    load_s = grouped(before, after, "modelyard_model_load_seconds_sum", ("kind",))
    waits = sum(grouped(before, after, "modelyard_admission_wait_seconds_count", ()).values())
    buckets = grouped(before, after, "modelyard_admission_wait_seconds_bucket", ("le",))
    at_once = buckets.get("0.0", 0.0)  # the histogram's first bucket: no wait at all
    return {
        "evictions": int(sum(evictions.values())),
        "evictions_by_action": {k: int(v) for k, v in evictions.items()},
        "evictions_by_model_action_reason": {
            k: int(v)
            for k, v in grouped(
                before, after, "modelyard_model_evictions_total", ("model", "action", "reason")
            ).items()
        },
        "loads_by_kind": {k: int(v) for k, v in loads.items()},
        "load_seconds_sum_by_kind": load_s,
        "load_seconds_by_model_kind": grouped(
            before, after, "modelyard_model_load_seconds_sum", ("model", "kind")
        ),
        "held_requests": int(waits - at_once),
        "held_seconds_sum": round(
            sum(grouped(before, after, "modelyard_admission_wait_seconds_sum", ()).values()), 3
        ),
    }


_NOT_AWAKE = ("parked", "stopped", "failed")


def memory_use(timeline: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """From a stream's /admin/models samples: the most the gateway counted resident (and how many
    samples it was over ``budget``), the most the engines really held (RSS, and PSS with the
    engine templates: what the budget plans with), and the most models awake at once (every state
    but parked, stopped and failed)."""
    resident = [s["resident_bytes"] for s in timeline]
    rss = [s["engine_rss_bytes"] for s in timeline]
    pss = [s["engine_pss_bytes"] for s in timeline]
    awake = [sum(m[0] not in _NOT_AWAKE for m in s["models"].values()) for s in timeline]
    return {
        "samples": len(timeline),
        "budget_bytes": budget,
        "max_resident_bytes": max(resident, default=None),
        "samples_over_budget": sum(r > budget for r in resident),
        "max_engine_rss_bytes": max(rss, default=None),
        "samples_engine_rss_over_budget": sum(r > budget for r in rss),
        "max_engine_pss_bytes": max(pss, default=None),
        "samples_engine_pss_over_budget": sum(p > budget for p in pss),
        "max_models_awake": max(awake, default=None),
        "samples_three_awake": sum(a >= 3 for a in awake),
    }


# ---- the memory budget -----------------------------------------------------------------------


def choose_budget(
    awake: dict[str, int],
    awake_low: dict[str, int],
    parked: dict[str, int],
    margin: float = 0.05,
    growth: int = 0,
) -> dict[str, Any]:
    """A host-memory budget that holds two models awake and the third parked, but not three awake.

    ``awake``: each model's footprint after a cold start; ``awake_low``: the smallest awake figure
    seen (after a wake an engine may hold less than after its load); ``parked``: measured parked
    footprints (empty: none could park); ``growth``: the largest of the models' structured-output
    growth, which the gateway reserves once beside whatever is awake. The rule: the two largest
    awake footprints plus the smallest parked floor plus ``growth``, plus ``margin``. If that
    would also hold the three smallest awake figures together (and ``growth``), the budget goes
    halfway between the two sums instead."""
    if len(awake) < 3:
        raise ValueError("need three models' awake footprints")
    two = sum(sorted(awake.values(), reverse=True)[:2])
    floor = min(parked.values()) if parked else DEFAULT_PARKED_FLOOR
    base = two + floor + growth
    formula = int(base * (1 + margin))
    lows = {m: min(awake[m], awake_low.get(m, awake[m])) for m in awake}
    three = sum(lows.values()) + growth
    budget, note = formula, None
    if formula >= three:
        if base < three:
            budget = (base + three) // 2
            note = (
                f"the formula's {formula / MiB:.0f} MiB would hold all three awake "
                f"({three / MiB:.0f} MiB at their smallest measured footprints): halfway between"
            )
        else:
            budget = base
            note = "no budget holds two awake plus a parked floor without holding all three"
    return {
        "cpu_bytes": budget,
        "formula_bytes": formula,
        "two_largest_awake_bytes": two,
        "parked_floor_bytes": floor,
        "parked_floor_source": "measured" if parked else "default (600 MiB)",
        "growth_bytes": growth,
        "margin": margin,
        "three_awake_smallest_bytes": three,
        "holds_three_awake": budget >= three,
        "adjusted": note,
    }


# ---- ratios ----------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(
    policies: dict[str, dict[str, Any]], timings: dict[str, dict[str, Any]], smollm: str
) -> dict[str, Any]:
    """``policies``: name -> summarize() of its stream; ``timings``: model -> the explicit
    warm / wake / cold measurements; ``smollm``: the SmolLM2 model whose wake and cold are set
    side by side."""

    def p99(name: str) -> float | None:
        return (policies.get(name) or {}).get("latency_s", {}).get("p99")

    park_over_resident = _ratio(p99("park_wake"), p99("all_resident"))
    cold_over_park = _ratio(p99("cold_swap"), p99("park_wake"))
    small = timings.get(smollm, {})
    wake_ttft = {m: t.get("wake", {}).get("ttft_s") for m, t in timings.items()}
    out: dict[str, Any] = {
        "park_wake_p99_over_all_resident_p99": park_over_resident,
        "cold_swap_p99_over_park_wake_p99": cold_over_park,
        f"{smollm}_wake_ttft_over_cold_ttft": _ratio(
            small.get("wake", {}).get("ttft_s"), small.get("cold", {}).get("ttft_s")
        ),
        f"{smollm}_wake_load_s_over_cold_load_s": _ratio(
            small.get("wake", {}).get("gateway_load_s"),
            small.get("cold", {}).get("gateway_load_s"),
        ),
        "wake_ttft_s": wake_ttft,
    }
    out["goals_met"] = {
        "park_wake_p99_over_all_resident_p99 <= 2": park_over_resident is not None
        and park_over_resident <= GOALS["park_wake_p99_over_all_resident_p99_max"],
        "cold_swap_p99_over_park_wake_p99 >= 3": cold_over_park is not None
        and cold_over_park >= GOALS["cold_swap_p99_over_park_wake_p99_min"],
        "wake_ttft <= 1 s": {
            m: v is not None and v <= GOALS["wake_ttft_s_max"] for m, v in wake_ttft.items()
        },
    }
    return out


# ---- what does not add up --------------------------------------------------------------------


def anomalies(report: dict[str, Any]) -> list[str]:
    """Plain-language notes on figures that contradict the set-up: a budget the gateway exceeded,
    three models awake under a budget of two, loads without the evictions that should make room,
    errors, awake footprints that shrink after a park/wake cycle."""
    notes: list[str] = []
    mib = 2**20
    fp = (report["policies"].get("all_resident") or {}).get("footprints") or {}
    for name, after_load in (fp.get("awake_after_load") or {}).items():
        after_wake = (fp.get("awake_after_wake") or {}).get(name)
        if after_wake and after_wake < 0.95 * after_load:
            notes.append(
                f"{name}: awake footprint {after_load / mib:.0f} MiB after its load but "
                f"{after_wake / mib:.0f} MiB after a park/wake cycle; the gateway plans with the "
                "latest figure"
            )
    for name, run in report["policies"].items():
        if "error" in run:
            notes.append(f"{name}: failed: {run['error']}")
            continue
        summary, swapped = run.get("summary") or {}, run.get("swaps") or {}
        if summary.get("errors"):
            notes.append(f"{name}: {summary['errors']} requests failed: {summary['error_samples']}")
        if name == "all_resident":
            continue
        mem = run.get("memory_during_stream") or {}
        if mem.get("samples_over_budget"):
            notes.append(
                f"{name}: the gateway counted {mem['max_resident_bytes'] / mib:.0f} MiB resident, "
                f"over its {mem['budget_bytes'] / mib:.0f} MiB budget, in "
                f"{mem['samples_over_budget']} of {mem['samples']} samples"
            )
        if mem.get("samples_three_awake"):
            notes.append(
                f"{name}: three models awake at once under a budget of two in "
                f"{mem['samples_three_awake']} of {mem['samples']} samples"
            )
        loads = swapped.get("loads_by_kind") or {}
        evictions = swapped.get("evictions_by_action") or {}
        freed = evictions.get("stop", 0) + evictions.get("park", 0)
        came = loads.get("cold", 0) + loads.get("wake", 0)
        if came > freed:
            notes.append(
                f"{name}: {came} loads (cold {loads.get('cold', 0)}, wake {loads.get('wake', 0)}) "
                f"but only {freed} evictions made room during the stream"
            )
    return notes
