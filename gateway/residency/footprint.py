"""What one engine replica takes: its memory awake and parked, on the host and on the GPU.

Measured figures come from the engine's ``GET /status`` (``memory.rss_bytes``, plus
``activation_bytes`` while awake) once it is ready and again once it is parked. Before a model's
first measurement, an estimate: ``memory_estimate`` from models.yaml, or the runtime, the weights
as the engine will hold them and the KV budget. A GGUF's weights are dequantised to fp32 and held
twice on CPU (the prepacked GEMM copy), about 13x the quantised file (SmolLM2-135M Q4_1: a 98 MB
file, 1.8 GB resident besides its KV cache).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gateway.config import ModelConfig

RUNTIME_BYTES = 512 * 2**20  # interpreter, torch, tokenizer: what a parked engine keeps
ENGINE_KV_DEFAULT = 512 * 2**20  # the engine's --kv-cache-memory default (engine/config.py)
_GGUF_EXPANSION = 13
_FOLDER_EXPANSION = 2  # fp32 checkpoint + its prepacked copy
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass
class Footprint:
    """One replica of a model; ``measured`` once the engine reported its own figures."""

    awake_bytes: int
    parked_bytes: int
    gpu_fraction: float = 0.0
    measured: bool = False

    def describe(self) -> dict[str, object]:
        return {
            "awake_bytes": self.awake_bytes,
            "parked_bytes": self.parked_bytes,
            "gpu_fraction": self.gpu_fraction,
            "source": "measured" if self.measured else "estimated",
        }


def estimate(model: ModelConfig) -> Footprint:
    """The footprint to plan with before the engine has reported one."""
    gpu = model.gpu_share
    if model.memory_estimate is not None:
        awake = model.memory_estimate
    else:
        weights = _weight_bytes(Path(model.source or ""))
        kv = 0 if gpu else (model.kv_cache_memory or ENGINE_KV_DEFAULT)
        awake = RUNTIME_BYTES + (weights if gpu else weights * _expansion(model)) + kv
    return Footprint(awake, min(awake, RUNTIME_BYTES), gpu)


def _expansion(model: ModelConfig) -> int:
    return _GGUF_EXPANSION if (model.source or "").lower().endswith(".gguf") else _FOLDER_EXPANSION


def _weight_bytes(source: Path) -> int:
    try:
        if source.is_file():
            return source.stat().st_size
        return sum(p.stat().st_size for p in source.rglob("*") if p.suffix in _WEIGHT_SUFFIXES)
    except OSError:
        return 0


def machine_ram_bytes() -> int:
    """MemTotal of /proc/meminfo (or the physical pages where that is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measured_bytes(status: dict[str, object] | None, awake: bool) -> int | None:
    """What an engine's /status answer says it takes: its resident memory (``memory.rss_bytes``)
    plus, awake, the activation peak its steps add on top of the resting figure
    (``memory.activation_bytes``, when reported); None when it reports no RSS."""
    memory = status.get("memory") if isinstance(status, dict) else None
    if not isinstance(memory, dict):
        return None
    rss, activations = memory.get("rss_bytes"), memory.get("activation_bytes")
    if not _count(rss) or rss <= 0:
        return None
    return rss + (activations if awake and _count(activations) else 0)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
