"""What every attention call of one forward reads: the step's layout, the KV pools, the backend,
and the step's attention bookkeeping (layers called; time, into the step profile when it is on).
Device-neutral: a backend's own fast calls (the CPU fast path's fused decode,
engine.model.cpu.fused_decode) read the step from here and book themselves through `attended`."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine.model.attention.backends import paged_attention
from engine.model.attention.metadata import AttentionMetadata
from engine.model.step_profile import ATTENTION, QKV_IN_ATTENTION, StepProfile

# The keyword under which transformers' forward passes a step's StepContext down to the attention
# function (engine.model.transformers_attention).
CONTEXT_KWARG = "modelyard_step"


@dataclass
class StepContext:
    """What every attention call of one forward needs."""

    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: str  # the model's attention backend (engine.model.attention.backends)
    profile: StepProfile | None = None  # set while profiling: attention calls are timed into it
    layers_called: set[int] = field(default_factory=set)

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Paged attention of one layer: query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]."""
        k_cache, v_cache = self.kv_caches[layer]
        started = self.clock()
        out = paged_attention(
            query,
            key,
            value,
            k_cache,
            v_cache,
            self.meta,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            backend=self.backend,
        )
        return self.attended(layer, started, out)

    def clock(self) -> float:
        """The time an attention call starts at; 0.0, and no clock read, while not profiling."""
        return time.perf_counter() if self.profile is not None else 0.0

    def attended(
        self, layer: int, started: float, out: torch.Tensor, qkv_s: float | None = None
    ) -> torch.Tensor:
        """Book a layer's attention call that began at ``started`` (`clock`), ``qkv_s`` of it
        spent in the layer's qkv GEMM when the call ran that too; returns its output."""
        if self.profile is not None:
            if qkv_s is not None:
                self.profile.add(QKV_IN_ATTENTION, qkv_s)
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            self.profile.add(ATTENTION, time.perf_counter() - started)
        self.layers_called.add(layer)
        return out

    def attended_all(self, spans: Iterable[tuple[float, float]]) -> None:
        """Book one call that ran every layer's attention; ``spans``, timed while profiling:
        (qkv GEMM seconds, attention seconds) of each layer."""
        if self.profile is not None:
            for qkv_s, attention_s in spans:
                self.profile.add(ATTENTION, attention_s)
                self.profile.add(QKV_IN_ATTENTION, qkv_s)
        self.layers_called.update(range(len(self.kv_caches)))
