"""The three policies, each on a fresh gateway process replaying the same stream: all resident
(budget lifted, every model loaded first), cold swapping (a budget of two, every eviction a stop)
and park/wake (the same budget, evictions park). Also what the first run measures for the budget
(footprints awake, parked, awake again after a wake, and which endpoint each model takes) and the
per-model warm / wake / cold timings measured at the end of the park/wake run."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.residency_bench.client import CHAT, COMPLETIONS, one_request, replay
from scripts.residency_bench.gateway import Gateway, models_yaml
from scripts.residency_bench.stream import StreamRequest, warm_up_order
from scripts.residency_bench.summary import memory_use, summarize, swaps

log = logging.getLogger("bench_residency")
WARM_REQUESTS = 3
TIMELINE_S = 0.5  # how often /admin/models is sampled during a stream


@dataclass
class Settings:
    models: list[dict[str, Any]]  # name, source
    engine: dict[str, Any]  # models_yaml's engine settings
    stream: list[StreamRequest]
    clients: int
    max_tokens: int
    max_seconds: float
    log_dir: Path
    endpoints: dict[str, str] = field(default_factory=dict)  # model -> chat | completions

    @property
    def names(self) -> list[str]:
        return [m["name"] for m in self.models]


async def _load(gw: Gateway, name: str) -> dict[str, Any]:
    status, body, seconds = await gw.admin(name, "load")
    if status != 200:
        raise RuntimeError(f"{gw.name}: loading {name} answered {status}: {body}")
    log.info("%s: %s loaded in %.2f s", gw.name, name, seconds)
    return {"model": name, "seconds": round(seconds, 3), "state": body.get("state")}


async def _endpoint(gw: Gateway, name: str, max_tokens: int) -> str:
    """Chat when the model has a chat template, else completions (a base model's GGUF)."""
    record = await one_request(gw.session, gw.url, name, CHAT, "Say hi.", max_tokens)  # type: ignore[arg-type]
    if record.status == 400 and "chat template" in (record.error or ""):
        return COMPLETIONS
    if not record.ok:
        raise RuntimeError(f"{gw.name}: probe of {name} failed: {record.status} {record.error}")
    return CHAT


async def _stream(gw: Gateway, s: Settings) -> dict[str, Any]:
    """The stream against ``gw``, with the gateway's residency metrics around it."""
    before = await gw.metrics()
    assert gw.session is not None
    started = time.perf_counter()
    limit = int(s.max_seconds / TIMELINE_S) + 10
    sampler = asyncio.ensure_future(gw.timeline(started, TIMELINE_S, limit))
    records, duration = await replay(
        gw.session, gw.url, s.stream, s.endpoints, s.clients, s.max_tokens, s.max_seconds
    )
    sampler.cancel()
    timeline = await sampler
    after = await gw.metrics()
    states = {n: m["state"] for n, m in (await gw.models()).items()}
    log.info("%s: stream done in %.1f s", gw.name, duration)
    budget = (await gw.get_json("/admin/models"))["memory"]["cpu_bytes"]
    return {
        "summary": summarize(records, duration),
        "swaps": swaps(before, after),
        "memory_during_stream": memory_use(timeline, budget),
        "states_after": states,
        "requests": [r.to_json() for r in records],
        "timeline": timeline,
    }


async def run_all_resident(s: Settings, cpu_bytes: int) -> dict[str, Any]:
    """Policy 1, and the footprints the budget is computed from: every model loaded (cold), its
    awake footprint read; each parked once (parked floor) and woken (awake figure after a wake);
    then the stream with all three awake."""
    gw = Gateway("all_resident", _document(s, cpu_bytes, park=True, estimates=None), s.log_dir)
    out: dict[str, Any] = {"memory": {"cpu_bytes": cpu_bytes, "park": True}}
    try:
        await gw.start()
        out["setup"] = [await _load(gw, n) for n in s.names]
        # measured, not the estimate the gateway plans with until the engine's /status is read
        footprints = {n: await gw.measured_footprint(n) for n in s.names}
        awake = {n: footprints[n]["awake_bytes"] for n in s.names}
        growth = {n: footprints[n].get("growth_bytes", 0) for n in s.names}
        parked: dict[str, int] = {}
        awake_after_wake: dict[str, int] = {}
        park_refused: dict[str, str] = {}
        for name in s.names:
            before = (await gw.models())[name]["footprint"]["parked_bytes"]
            status, body, seconds = await gw.admin(name, "park")
            if status != 200 or body.get("state") != "parked":
                park_refused[name] = f"{status}: state {body.get('state')}"
                continue
            parked[name] = await gw.footprint_change(name, "parked_bytes", before)
            out["setup"].append({"model": name, "park_s": round(seconds, 3)})
        for name in parked:
            before = (await gw.models())[name]["footprint"]["awake_bytes"]
            out["setup"].append({**await _load(gw, name), "action": "wake"})
            awake_after_wake[name] = await gw.footprint_change(name, "awake_bytes", before)
        out["footprints"] = {
            "awake_after_load": awake,
            "parked": parked,
            "awake_after_wake": awake_after_wake,
            "park_refused": park_refused,
            "growth": growth,
        }
        s.endpoints.update({n: await _endpoint(gw, n, s.max_tokens) for n in s.names})
        out["endpoints"] = dict(s.endpoints)
        out.update(await _stream(gw, s))
    except Exception as error:  # recorded, with the shutdown that follows
        log.exception("%s failed", gw.name)
        out["error"] = f"{type(error).__name__}: {error}"
    finally:
        out["shutdown"] = await gw.stop()
    return out


async def run_swapping(
    s: Settings, name: str, cpu_bytes: int, park: bool, estimates: dict[str, int]
) -> dict[str, Any]:
    """Policy 2 (``park`` False) or 3 (True) on the budget: a warm-up that leaves the stream's
    first two favourites awake (stream.warm_up_order), then the stream; after park/wake, the
    per-model timings."""
    gw = Gateway(name, _document(s, cpu_bytes, park, estimates), s.log_dir)
    out: dict[str, Any] = {"memory": {"cpu_bytes": cpu_bytes, "park": park}}
    try:
        await gw.start()
        before = await gw.metrics()
        out["setup"] = [await _load(gw, n) for n in warm_up_order(s.names, park)]
        out["setup_swaps"] = swaps(before, await gw.metrics())
        out["models_before"] = {
            n: {"state": m["state"], "footprint": m["footprint"]}
            for n, m in (await gw.models()).items()
        }
        out.update(await _stream(gw, s))
        if park:
            out["timings"] = {n: await _timings(gw, s, n) for n in s.names}
        out["memory_after"] = (await gw.get_json("/admin/models"))["memory"]
    except Exception as error:  # recorded, with the shutdown that follows
        log.exception("%s failed", gw.name)
        out["error"] = f"{type(error).__name__}: {error}"
    finally:
        out["shutdown"] = await gw.stop()
    return out


async def _timings(gw: Gateway, s: Settings, name: str) -> dict[str, Any]:
    """warm: median TTFT of 3 requests to the loaded model; wake: one request right after
    POST park (the gateway wakes it while the request waits); cold: one request right after
    POST unload (a cold start while it waits). Each with the gateway's load seconds and any
    evictions it took (none expected: the model held that memory a moment before)."""
    endpoint = s.endpoints[name]
    assert gw.session is not None
    await _load(gw, name)
    warm = [
        await one_request(gw.session, gw.url, name, endpoint, f"Warm {i}: say hi.", s.max_tokens)
        for i in range(WARM_REQUESTS)
    ]
    ttfts = [r.ttft_s for r in warm if r.ok and r.ttft_s is not None]
    out: dict[str, Any] = {
        "warm": {
            "ttft_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "ttfts_s": [round(t, 4) for t in ttfts],
            "errors": len(warm) - len(ttfts),
        }
    }
    for kind, action in (("wake", "park"), ("cold", "unload")):
        status, body, seconds = await gw.admin(name, action)
        before = await gw.metrics()
        t0 = time.perf_counter()
        record = await one_request(
            gw.session, gw.url, name, endpoint, f"{kind.title()}: say hi.", s.max_tokens
        )
        delta = swaps(before, await gw.metrics())
        out[kind] = {
            f"{action}_s": round(seconds, 3),
            "state_before_request": body.get("state") if status == 200 else f"HTTP {status}",
            "ttft_s": round(record.ttft_s, 4) if record.ok and record.ttft_s else None,
            "latency_s": round(record.latency_s or time.perf_counter() - t0, 4),
            "status": record.status,
            "error": record.error,
            "gateway_load_s": delta["load_seconds_sum_by_kind"].get(kind),
            "gateway_loads": delta["loads_by_kind"],
            "evictions": delta["evictions_by_model_action_reason"],
        }
        log.info("%s: %s %s TTFT %s s", gw.name, name, kind, out[kind]["ttft_s"])
    return out


def _document(
    s: Settings, cpu_bytes: int, park: bool, estimates: dict[str, int] | None
) -> dict[str, Any]:
    models = [{**m, "memory_estimate": (estimates or {}).get(m["name"])} for m in s.models]
    return models_yaml(models, cpu_bytes, park, s.engine)
