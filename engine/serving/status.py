"""GET /status: the engine's memory now, for a supervisor that plans where models fit, built on
the event loop from the engine thread's latest footprint and this process's /proc counters; and
its start-up stage, which it answers from the moment it listens, while the model loads."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from common.processes import mapping_bytes, peak_rss_bytes, pss_bytes, rss_bytes
from engine import startup


def structured_memory(grammars: Any) -> dict[str, int]:
    """What structured outputs hold (engine.structured.compiler.CompilerStats): grammars cached
    or in use (inside rss_bytes), their budget, the compile workers (child processes, outside
    it), and what all of it may still add to rss_bytes plus the workers' (a supervisor plans
    with rss_bytes + that)."""
    if grammars is None:
        return {}
    return {
        "structured_cache_bytes": grammars.cache_bytes,
        "structured_cache_budget_bytes": grammars.cache_budget_bytes,
        "compile_workers_rss_bytes": grammars.workers_rss_bytes,
        "structured_headroom_bytes": grammars.headroom_bytes,
    }


def weights_pss_bytes(footprint: Any) -> int:
    """What the weights count for in this process's PSS, which a park releases: weights_bytes,
    with the pages of a mapped packed file counted at this process's share of them (the others
    are the page cache's, counted in the PSS of every engine that maps the same file)."""
    mapped = footprint.mapped_weights
    if mapped is None or footprint.sleeping:
        return footprint.weights_bytes
    address, nbytes = mapped
    share = mapping_bytes(address, "Pss")
    if share is None:
        return footprint.weights_bytes
    # the mapping's PSS counts its page padding too: never more than the weights themselves
    return min(footprint.weights_bytes, max(0, footprint.weights_bytes - nbytes) + share)


def status_body(model: str, sleeping: bool, footprint: Any, grammars: Any = None) -> dict[str, Any]:
    """``footprint``: the core's MemoryFootprint (engine.model.footprint), None where the core
    does not measure one; ``grammars``: its compiler's CompilerStats, None without one."""
    process = {
        "rss_bytes": rss_bytes(),
        "pss_bytes": pss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
        **structured_memory(grammars),
    }
    if footprint is None:
        return {"model": model, "sleeping": sleeping, "memory": process, "startup": startup.stage()}
    memory = {
        "weights_bytes": footprint.weights_bytes,
        "weights_pss_bytes": weights_pss_bytes(footprint),
        "kv_cache_bytes": footprint.kv_cache_bytes,
        "activation_bytes": footprint.activation_bytes,
        "activation_bytes_source": "measured" if footprint.activation_measured else "estimate",
        **process,
    }
    return {
        "model": model,
        "sleeping": sleeping,
        "device": footprint.device,
        "memory": memory,
        "park": asdict(footprint.park),
        "startup_s": {name: round(s, 3) for name, s in startup.phases().items()},
        "startup": startup.stage(),
    }
