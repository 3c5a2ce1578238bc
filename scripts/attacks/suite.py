"""One run per checkout: the fleet started, the victim and the sampler running, the attacks
replayed in order (each bounded, a failure its result), the fleet stopped."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from scripts.attacks.bodies import big_prompt, encoded_body, small_bodies
from scripts.attacks.choices import many_choices
from scripts.attacks.compile_time import anyof_stall, pattern_properties_stall
from scripts.attacks.connections import half_open
from scripts.attacks.context import ATTACK_CAP_S, Ctx
from scripts.attacks.ejection import ejection
from scripts.attacks.empty_messages import empty_messages
from scripts.attacks.engine_watch import EngineWatch
from scripts.attacks.fleet import MODEL, Fleet, checkout_state
from scripts.attacks.grammar_cache import regex_cache
from scripts.attacks.grammar_crash import grammar_crash
from scripts.attacks.raw_http import CHAT, COMPLETIONS, VICTIM_ADDRESS, http_request
from scripts.attacks.residency import park_load_loop, unload_during_load
from scripts.attacks.rss import RssSampler
from scripts.attacks.slow import slow_clients
from scripts.attacks.victim import Victim, finished, overlapping, probe_stats
from scripts.fuzzer.structured_cases import tiny_schema_request

SETTLE_CAP_S = 180.0  # a crash loop's end, or an unload and a cold load
PROBE_TIMEOUT_S = 15.0
RESET_GROWTH_MB = 1024

# In this order, on one fleet. An attack's harm can outlast it: at the baseline every ejection
# lengthens the next (base_s x count, forgotten after max_s), so 3, which measures ejection
# windows, goes first; later attacks then meet the longer ejections it leaves, as clients would.
ATTACKS: dict[str, Callable[[Ctx], Awaitable[dict]]] = {
    "3_ejection_rounds": ejection,
    "1a_deflate_bomb_gateway": encoded_body("deflate_bomb", "deflate", "gateway"),
    "1b_gzip_spaces_gateway": encoded_body("gzip_spaces", "gzip", "gateway"),
    "1c_deflate_bomb_engine": encoded_body("deflate_bomb", "deflate", "engine"),
    "1d_gzip_spaces_engine": encoded_body("gzip_spaces", "gzip", "engine"),
    "2_n10000_gateway": many_choices,
    "4a_4mb_chat_gateway": big_prompt("big_chat", CHAT, "gateway"),
    "4b_4mb_completion_gateway": big_prompt("big_completion", COMPLETIONS, "gateway"),
    "4c_4mb_chat_engine": big_prompt("big_chat", CHAT, "engine"),
    "4d_4mb_completion_engine": big_prompt("big_completion", COMPLETIONS, "engine"),
    "6_small_bodies": small_bodies,
    "5a_slow_clients": slow_clients,
    "5b_half_open_connections": half_open,
    # Issue 29 ("h", hardening): constraints that crash, stall or bloat the engine, floods of
    # empty messages, and residency changes under traffic. Each starts on a working engine:
    # settle() loads a model a crash loop left failed, and replaces an engine whose grammar
    # compiles are wedged.
    "h1a_deep_ref_schema": grammar_crash("schema"),
    "h1b_lark_rule_chain": grammar_crash("lark"),
    "h1c_tool_ref_chain": grammar_crash("tools"),
    "h2_pattern_properties": pattern_properties_stall,
    "h3_anyof_branches": anyof_stall,
    "h4_regex_cache": regex_cache,
    "h5_empty_messages": empty_messages,
    "h6a_park_load_loop": park_load_loop,
    "h6b_unload_during_load": unload_during_load,
}


async def settle(ctx: Ctx) -> dict[str, Any]:
    """Waits (bounded) until the victim's model is ready again, loading it when a crash loop left
    it failed, and refreshes the engine's address; then the engine is replaced (unload and load)
    when a tiny schema does not compile or it holds RESET_GROWTH_MB more than it started with: a
    wedged compiler or a bloated cache would be the next attack's harm."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"model": await asyncio.to_thread(ctx.fleet.recover, SETTLE_CAP_S)}
    probe = tiny_schema_request(MODEL, f"settle {time.monotonic_ns()}").body
    answer = await http_request(ctx.fleet.url, "POST", CHAT, probe, timeout=PROBE_TIMEOUT_S)
    growth = ctx.sampler.growth_mb("engine")
    if answer.status != 200 or growth > RESET_GROWTH_MB:
        out |= {"tiny_schema": answer.text(), "engine_rss_growth_mb": round(growth)}
        out["reset"] = await asyncio.to_thread(ctx.fleet.reset, SETTLE_CAP_S)
    return {**out, "settle_s": round(time.monotonic() - t0, 2)}


async def run_attack(ctx: Ctx, attack: Callable[[Ctx], Awaitable[dict]]) -> dict[str, Any]:
    settled = await settle(ctx)
    watch = EngineWatch(ctx.fleet)
    await watch.start()
    t0 = time.monotonic()
    try:
        detail = await asyncio.wait_for(attack(ctx), ATTACK_CAP_S)
    except Exception as exc:  # one attack's failure is its result, not the run's end
        detail = {"error": f"{type(exc).__name__}: {exc}"}
    t1 = time.monotonic()
    await asyncio.sleep(ctx.args.after_s)
    t2 = time.monotonic()
    engine = await watch.figures()
    victim = ctx.victim
    during = probe_stats(await finished(overlapping(victim.chats, t0, t1)))
    after = probe_stats(await finished([p for p in list(victim.chats) if t1 <= p.start < t2]))
    health = {  # during and right after: a stalled event loop may outlast the answer
        name: probe_stats(await finished(overlapping(probes, t0, t2)))
        for name, probes in victim.health.items()
    }
    rss = {role: ctx.sampler.figures(role, t0, t1) for role in ("gateway", "engine")}
    figures = {
        **detail.pop("figures", {}),
        "victim_ok": f"{during['ok']}/{during['count']}",
        "victim_p50_ms": during["p50_ms"],
        "victim_p99_ms": during["p99_ms"],
        "victim_max_ms": during["max_ms"],
        "victim_ok_after": f"{after['ok']}/{after['count']}",
        "gateway_health_max_ms": health["gateway"]["max_ms"],
        "engine_health_max_ms": health["engine"]["max_ms"],
        "gateway_rss_peak_mb": rss["gateway"]["peak_mb"],
        "engine_rss_peak_mb": rss["engine"]["peak_mb"],  # with its descendants
        **engine,
    }
    if "error" in detail:
        figures["error"] = detail["error"]
    return {
        "settle": settled,
        "seconds": round(t1 - t0, 2),
        "attack": detail,
        "victim_during": during,
        "victim_after": after,
        "health": health,
        "rss": rss,
        "figures": figures,
    }


async def run_attacks(ctx: Ctx, names: list[str]) -> dict[str, Any]:
    results = {}
    for name in names:
        print(f"  {name} ...", file=sys.stderr, flush=True)
        results[name] = await run_attack(ctx, ATTACKS[name])
        print(f"    {json.dumps(results[name]['figures'])}", file=sys.stderr, flush=True)
    return results


def run_suite(
    repo: Path, args: argparse.Namespace, payloads: dict[str, bytes], names: list[str]
) -> dict:
    """Starts the fleet from ``repo``, replays the attacks, stops it."""
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="modelyard-attacks-"))
    fleet = Fleet(repo, workdir, args.model)
    out: dict[str, Any] = {"repo": str(repo), **checkout_state(repo), "log": str(fleet.log)}
    victim = Victim(fleet, args.victim_concurrency, VICTIM_ADDRESS)
    sampler = RssSampler(fleet)
    try:
        out["imports"] = fleet.imports()
        print(f"{repo}: {out['imports']}", file=sys.stderr, flush=True)
        fleet.start(args.ready_timeout)
        out["engine_start_s"] = round(time.monotonic() - started, 1)
        sampler.start()
        victim.start()
        warm_deadline = time.monotonic() + 60
        while sum(p.ok for p in list(victim.chats)) < 3 and time.monotonic() < warm_deadline:
            time.sleep(0.2)
        ctx = Ctx(fleet, victim, sampler, args, payloads)
        out["attacks"] = asyncio.run(run_attacks(ctx, names))
    except Exception as exc:  # reported: the other checkout still runs
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["log_tail"] = (
            fleet.log.read_text(errors="replace")[-3000:] if fleet.log.exists() else ""
        )
        print(f"{repo}: {out['error']}", file=sys.stderr, flush=True)
    finally:
        victim.stop()
        sampler.stop()
        out["stop"] = fleet.stop()
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def selected(only: str) -> list[str]:
    """The attacks whose id (the name's first part) starts with one of ``only``'s: ``1`` is
    1a-1d, ``h1`` is h1a-h1c, ``h`` all of issue 29's."""
    ids = [i for i in only.split(",") if i]
    names = [n for n in ATTACKS if not ids or n.split("_", 1)[0].startswith(tuple(ids))]
    if not names:
        raise SystemExit(f"--only {only!r} matches none of {', '.join(ATTACKS)}")
    return names
