"""GET /status: the engine's memory now, for a supervisor that plans where models fit, built on
the event loop from the engine thread's latest footprint and this process's /proc counters; and
its start-up stage, which it answers from the moment it listens, while the model loads."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from common.processes import peak_rss_bytes, pss_bytes, rss_bytes
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
