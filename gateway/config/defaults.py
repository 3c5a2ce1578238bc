"""The ``defaults`` section, and the engine settings it shares with each local model: a model's
own value wins over the section's, which wins over ``ModelDefaults``'."""

from __future__ import annotations

from gateway.config.reader import Reader
from gateway.config.schema import DEVICES, ModelDefaults


def read_defaults(r: Reader) -> ModelDefaults:
    defaults = read_engine_settings(r, ModelDefaults())
    r.finish()
    return defaults


def read_engine_settings(r: Reader, base: ModelDefaults) -> ModelDefaults:
    """``device``, ``max_model_len``, ``max_num_seqs``, ``gpu_memory_fraction`` and
    ``kv_cache_memory`` from ``r``, each one absent taken from ``base``."""
    return ModelDefaults(
        device=r.string("device", base.device, choices=DEVICES) or base.device,
        max_model_len=r.integer("max_model_len", base.max_model_len, minimum=16),
        max_num_seqs=r.integer("max_num_seqs", base.max_num_seqs),
        gpu_memory_fraction=r.number(
            "gpu_memory_fraction",
            base.gpu_memory_fraction,
            minimum=0,
            maximum=1,
            exclusive_min=True,
        ),
        kv_cache_memory=r.size("kv_cache_memory", base.kv_cache_memory),
    )
