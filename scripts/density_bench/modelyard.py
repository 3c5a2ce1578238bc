"""Modelyard's side: one gateway with ``max_copies`` on-demand copies of the GGUF under distinct
names and the budget (park on), filled copy by copy until it parks one to make room; then the
round across the copies awake, the engines' memory (their GET /status), one copy parked by hand,
and the memory again.

Every copy plans with the awake footprint one copy measured alone first (a probe gateway), as
``memory_estimate``: otherwise each copy's first load would plan with the gateway's pessimistic
estimate for a GGUF (docs/OPERATIONS.md, Residency) and the count would be the estimate's."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import aiohttp

from scripts.density_bench.fill import Load, awake, fill_gateway
from scripts.density_bench.round import request_round
from scripts.density_bench.settings import Settings
from scripts.peers.cells import Target
from scripts.residency_bench.gateway import Gateway, models_yaml
from scripts.serving.client import Client
from scripts.serving.results import RequestResult
from scripts.serving.workload import RequestSpec

log = logging.getLogger("bench_density")
LOAD_PROMPT = "Once upon a time"
RUNNING = ("ready", "parking", "parked", "waking")  # states whose engine process answers /status


def _document(s: Settings, names: list[str], estimate: int | None) -> dict[str, Any]:
    source = str(s.model.path.resolve())  # the gateway reads a relative one from the config's dir
    models = [{"name": n, "source": source, "memory_estimate": estimate} for n in names]
    return models_yaml(models, s.budget_bytes, park=True, engine=s.engine())


async def _request(gw: Gateway, name: str, max_tokens: int) -> Load:
    """One completion for ``name`` through the gateway: it loads the copy first."""
    assert gw.session is not None
    result = RequestResult(ok=False, start=time.perf_counter())
    client = Client(gw.url, name, "completions", True, None)
    await client.send(gw.session, RequestSpec(LOAD_PROMPT, max_tokens), result)
    return Load(result.ok, time.perf_counter() - result.start, result.error)


async def _states(gw: Gateway) -> dict[str, str]:
    return {name: m["state"] for name, m in (await gw.models()).items()}


async def probe(s: Settings) -> dict[str, Any]:
    """One copy alone under the budget: its measured awake footprint and cold load time."""
    name = f"{s.model.name}-probe"
    gw = Gateway("density-probe", _document(s, [name], None), s.log_dir)
    out: dict[str, Any] = {}
    try:
        await gw.start()
        estimate = (await gw.models())[name]["footprint"]["awake_bytes"]
        status, body, seconds = await gw.admin(name, "load")
        if status != 200:
            raise RuntimeError(f"probe load answered {status}: {body}")
        out["load_s"] = round(seconds, 3)
        out["estimate_bytes"] = estimate
        out["awake_bytes"] = await gw.footprint_change(name, "awake_bytes", estimate)
        out["source"] = (await gw.models())[name]["footprint"]["source"]
    finally:
        out["shutdown"] = await gw.stop()
    return out


async def engine_memory(gw: Gateway, models: dict[str, dict[str, Any]]) -> dict[str, dict]:
    """Each running copy's state, pid and its engine's own figures (GET /status: rss_bytes,
    pss_bytes, sleeping)."""
    assert gw.session is not None
    out: dict[str, dict] = {}
    for name, model in models.items():
        replicas = [r for r in model["replicas"] if r.get("url") and r.get("pid")]
        if model["state"] not in RUNNING or not replicas:
            continue
        entry: dict[str, Any] = {"state": model["state"], "pid": replicas[0]["pid"]}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with gw.session.get(replicas[0]["url"] + "/status") as reply:
                status = await reply.json()
                memory = status.get("memory", {})
                entry |= {k: memory.get(k) for k in ("rss_bytes", "pss_bytes")}
                entry["sleeping"] = status.get("sleeping")
        out[name] = entry
    return out


def memory_totals(copies: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Per state: how many copies, their summed RSS and PSS (PSS counts a page the engines
    share once over all of them, so the sum is what they hold together)."""
    totals: dict[str, dict[str, int]] = {}
    for copy in copies.values():
        t = totals.setdefault(copy["state"], {"copies": 0, "rss_bytes": 0, "pss_bytes": 0})
        t["copies"] += 1
        t["rss_bytes"] += copy.get("rss_bytes") or 0
        t["pss_bytes"] += copy.get("pss_bytes") or 0
    return totals


async def _memory(gw: Gateway) -> dict[str, Any]:
    state = await gw.get_json("/admin/models")
    copies = await engine_memory(gw, {m["name"]: m for m in state["models"]})
    return {"copies": copies, "totals": memory_totals(copies), "gateway": state["memory"]}


async def _count_and_measure(gw: Gateway, s: Settings, out: dict[str, Any]) -> None:
    """Fill the gateway, then with every copy awake: memory, the round; park one, memory."""

    async def load(name: str) -> Load:
        result = await _request(gw, name, s.max_tokens)
        log.info("modelyard: %s ok=%s in %.1f s", name, result.ok, result.seconds)
        return result

    names = s.copy_names()
    log.info("modelyard: loading up to %d copies", len(names))
    out["fill"] = await fill_gateway(load, lambda: _states(gw), names, s.fill_seconds)
    out["awake"] = up = awake(await _states(gw))
    out["memory_awake"] = await _memory(gw)
    pids = {n: c["pid"] for n, c in out["memory_awake"]["copies"].items()}
    targets = [Target(gw.url, n, pids.get(n, 0)) for n in up]
    log.info("modelyard: request round across %d copies", len(targets))
    out["round"] = await request_round(
        targets, s.clients, s.requests, s.max_tokens, s.round_seconds
    )
    if up:
        status, body, seconds = await gw.admin(up[0], "park")
        out["parked_by_hand"] = {
            "model": up[0], "status": status, "state": body.get("state"),
            "seconds": round(seconds, 3),
        }  # fmt: skip
        out["memory_after_park"] = await _memory(gw)


async def run(s: Settings, memory_estimate: int | None) -> dict[str, Any]:
    """The probe (unless ``memory_estimate`` is given), then the counting gateway, stopped with
    its engines whatever happens."""
    out: dict[str, Any] = {"engine_settings": s.engine()}
    if memory_estimate is None:
        log.info("modelyard: probing one copy's footprint")
        try:
            out["probe"] = await probe(s)
        except Exception as error:  # the probe stopped its gateway; nothing to count without it
            log.exception("modelyard probe failed")
            out["error"] = f"probe: {type(error).__name__}: {error}"
            return out
        memory_estimate = out["probe"]["awake_bytes"]
    out["memory_estimate_bytes"] = memory_estimate
    gw = Gateway("density", _document(s, s.copy_names(), memory_estimate), s.log_dir)
    try:
        await gw.start()
        await _count_and_measure(gw, s, out)
    except Exception as error:  # recorded with the shutdown that follows
        log.exception("modelyard side failed")
        out["error"] = f"{type(error).__name__}: {error}"
    finally:
        out["shutdown"] = await gw.stop()
    return out
