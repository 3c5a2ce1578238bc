"""What one engine replica takes: its memory awake and parked, on the host and on the GPU.

Measured figures come from the engine's ``GET /status`` once it is ready, again every
``MEASURE_EVERY_S`` while it serves (gateway/residency/manager.py), and once it is parked: its
memory (PSS, where engines share pages with their template) and activation peak, and apart from
them what structured outputs may still add (``growth_bytes``), which plan.py reserves once for
the fleet rather than once per model (see ``measured_bytes`` and ``measured_growth``).
Before a model's first measurement, an estimate: ``memory_estimate`` from models.yaml, or the
runtime, the weights as the engine will hold them, the KV budget and structured outputs' memory (the
grammar cache budget, a compile worker). A GGUF's tensors in a block type the narrow formats hold
(Q4_0/1, Q2_K, Q4_K, Q5_0/1, Q5_K, Q3_K, Q6_K, Q8_0, IQ4_NL, IQ4_XS) stay in those blocks, with
fp32 scales or, Q8_0's, Q5_0's and the K-quants' (Q2_K, Q4_K, Q5_K), their own (1-1.35x their
bytes: Q8_0 and Q5_0 1x, Q2_K, Q4_K and Q5_K 1.05x; Q3_K 3.2x, the IQ4s 2x); the others are
dequantised to fp32 (up to 8x), and the tokenizer comes on top (Gemma 3's 262,144-token one: ~100
MB in the engine; structured outputs' vocabulary is in the engine's headroom until built).
Measured, Gemma 3 270M Q4_K_M and SmolLM2-135M Q4_1 hold 2-3x their files once the runtime and KV
are taken off (docs/PERFORMANCE.md#model-loading); the estimate takes 3x, so that no file is
under-counted until its first start measures it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common.sizes import parse_size
from gateway.config import ModelConfig

RUNTIME_BYTES = 512 * 2**20  # interpreter, torch, tokenizer: what a parked engine keeps
ENGINE_KV_DEFAULT = 512 * 2**20  # the engine's --kv-cache-memory default (engine/config.py)
STRUCTURED_CACHE_FLAG = "--structured-cache-memory"  # compiled grammars the engine keeps
ENGINE_STRUCTURED_CACHE_DEFAULT = 256 * 2**20  # that flag's default
# One grammar-compile worker process (the engine's default count): the interpreter, llguidance
# and the tokenizer (about 100 MB for a 49k vocabulary)
COMPILE_WORKER_ESTIMATE = 128 * 2**20
GGUF_EXPANSION = 3  # the weights and tokenizer as held over the file's size (see above)
FOLDER_EXPANSION = 2  # fp32 checkpoint + its prepacked copy
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass
class Footprint:
    """One replica of a model; ``measured`` once the engine reported its own figures."""

    awake_bytes: int
    parked_bytes: int
    gpu_fraction: float = 0.0
    measured: bool = False
    # awake, what structured outputs may still add: the grammar cache's room, compile workers not
    # running, the grammar vocabulary until built
    growth_bytes: int = 0
    parked_measured: bool = False  # else parked_bytes is an estimate (see parked_estimate)

    def describe(self) -> dict[str, object]:
        return {
            "awake_bytes": self.awake_bytes,
            "parked_bytes": self.parked_bytes,
            "growth_bytes": self.growth_bytes,
            "gpu_fraction": self.gpu_fraction,
            "source": "measured" if self.measured else "estimated",
        }


def estimate(model: ModelConfig) -> Footprint:
    """The footprint to plan with before the engine has reported one: ``memory_estimate``
    (growth included), or the runtime + the weights as held + the host KV budget (host memory on
    every device), and the structured-output cache budget and a compile worker as its growth.
    Parked, the runtime alone."""
    gpu = model.gpu_share
    if model.memory_estimate is not None:  # the operator's figure, everything in it
        return Footprint(model.memory_estimate, min(model.memory_estimate, RUNTIME_BYTES), gpu)
    weights = _weight_bytes(Path(model.source or ""))
    kv = 0 if gpu else (model.kv_cache_memory or ENGINE_KV_DEFAULT)
    held = weights if gpu else weights * _expansion(model)
    awake = RUNTIME_BYTES + held + kv
    growth = structured_cache_budget(model) + COMPILE_WORKER_ESTIMATE
    return Footprint(awake, min(awake, RUNTIME_BYTES), gpu, growth_bytes=growth)


def structured_cache_budget(model: ModelConfig) -> int:
    """The engine's ``--structured-cache-memory`` as the model's ``engine_args`` set it (either
    ``FLAG SIZE`` or ``FLAG=SIZE``), else its default; a size that does not parse (the engine
    would refuse to start) counts as the default."""
    args = model.engine_args
    for i, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag != STRUCTURED_CACHE_FLAG:
            continue
        if not equals:
            value = args[i + 1] if i + 1 < len(args) else ""
        try:
            return parse_size(value)
        except ValueError:
            break
    return ENGINE_STRUCTURED_CACHE_DEFAULT


def _expansion(model: ModelConfig) -> int:
    return GGUF_EXPANSION if (model.source or "").lower().endswith(".gguf") else FOLDER_EXPANSION


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
    """What an engine's /status answer says it takes; None when it reports no memory. Its
    memory now: its proportional set size (``memory.pss_bytes``) where it reports one, else its
    resident set (``rss_bytes``); and awake also the activation peak its steps add
    (``activation_bytes``) and its grammar-compile workers running now (child processes outside
    its own memory: ``compile_workers_rss_bytes``). A field an engine does not report (an older
    one, an external server) counts 0.

    PSS rather than RSS because engines forked from a template (gateway/engines/template.py)
    share the interpreter's and torch's pages with it: in RSS each of them would count those
    whole, in PSS each counts its share, and the template counts the rest once. An exec'd
    engine's PSS is its RSS less its shares of the libraries other processes map too."""
    memory = _memory(status)
    held = _bytes(memory, "pss_bytes") or _bytes(memory, "rss_bytes")
    if not held:
        return None
    if not awake:
        return held
    return held + _bytes(memory, "activation_bytes") + _bytes(memory, "compile_workers_rss_bytes")


def measured_growth(status: dict[str, object] | None) -> int:
    """What an awake engine's structured outputs may still add (``structured_headroom_bytes``:
    the room left in its grammar cache, its compile workers at their most and the grammar
    vocabulary until built) beyond what its workers hold now. Parked, the engine drops that
    cache and stops the workers."""
    memory = _memory(status)
    headroom = _bytes(memory, "structured_headroom_bytes")
    return max(0, headroom - _bytes(memory, "compile_workers_rss_bytes"))


def parked_estimate(status: dict[str, object] | None) -> int | None:
    """What an awake engine will hold parked, before it has been: its memory less the weights and
    KV cache a park releases (``kv_cache_bytes``; the weights at their share of its PSS,
    ``weights_pss_bytes``, where it reports PSS and that: an engine whose weights are a file
    mapped by other engines too holds only a share of them; else ``weights_bytes``); None where
    it does not report them (an older engine, an external server). Closer than the runtime's
    512 MiB for a small model, whose whole awake footprint can be less
    (docs/PERFORMANCE.md#residency)."""
    memory = _memory(status)
    pss = _bytes(memory, "pss_bytes")
    held = pss or _bytes(memory, "rss_bytes")
    weights = _bytes(memory, "weights_bytes")
    if pss and "weights_pss_bytes" in memory:
        weights = _bytes(memory, "weights_pss_bytes")
    released = weights + _bytes(memory, "kv_cache_bytes")
    if not held or not released:
        return None
    return max(held - released, 0)


def _memory(status: dict[str, object] | None) -> dict[str, object]:
    memory = status.get("memory") if isinstance(status, dict) else None
    return memory if isinstance(memory, dict) else {}


def _bytes(memory: dict[str, object], key: str) -> int:
    """``memory[key]`` when it is a byte count (a non-negative int), else 0."""
    value = memory.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
