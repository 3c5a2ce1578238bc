"""Residency settings: the fleet's memory budget (``gateway.memory``) and, per local model, how it
stays resident (``residency``, ``idle_ttl_s``, ``priority``, ``memory_estimate``). Defaults come
from schema.py."""

from __future__ import annotations

from gateway.config.reader import Reader
from gateway.config.schema import (
    MAX_GPU_FRACTION_SUM,
    RESIDENCY_KINDS,
    MemoryBudget,
    ModelConfig,
)


def read_memory(r: Reader) -> MemoryBudget:
    d = MemoryBudget()
    cpu = r.raw("cpu_bytes")
    budget = MemoryBudget(
        cpu_bytes=None if cpu == "auto" else r.size("cpu_bytes", d.cpu_bytes),
        auto_cpu_share=r.number("auto_cpu_share", d.auto_cpu_share, minimum=0, maximum=1,
                                exclusive_min=True),
        gpu_fraction=r.number("gpu_fraction", d.gpu_fraction, minimum=0,
                              maximum=MAX_GPU_FRACTION_SUM, exclusive_min=True),
        park=r.boolean("park", d.park),
    )  # fmt: skip
    r.finish()
    return budget


def read_residency(r: Reader, local: bool) -> dict[str, object]:
    """The residency fields of a model (keyword arguments of ModelConfig); only a local model
    may be on demand."""
    d = ModelConfig(name="")
    residency = r.string("residency", d.residency, choices=RESIDENCY_KINDS) or d.residency
    if residency == "on_demand" and not local:
        r.error("residency", "on_demand applies to local models (with `source`) only")
    for key in ("idle_ttl_s", "priority"):
        if residency == "pinned" and r.has(key):
            r.error(key, "applies to on_demand models only")
    return {
        "residency": residency,
        "idle_ttl_s": r.duration("idle_ttl_s", d.idle_ttl_s),
        "priority": r.integer("priority", d.priority, minimum=-1000, maximum=1000),
        "memory_estimate": r.size("memory_estimate", d.memory_estimate),
    }
