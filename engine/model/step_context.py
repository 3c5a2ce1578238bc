"""What every attention call of one forward reads: the step's layout, the KV pools, the backend,
and the step's attention bookkeeping (layers called; time, into the step profile when it is on)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.model.attention.backends import paged_attention
from engine.model.attention.metadata import AttentionMetadata
from engine.model.cpu.attention import fused_decode_step
from engine.model.cpu.kernels.narrow_decode import NarrowDecoder, NarrowOutput
from engine.model.cpu.kernels.paged_decode import DecodeStep
from engine.model.cpu.kernels.panel_gemm import PanelOperands
from engine.model.step_profile import ATTENTION, QKV_IN_ATTENTION, StepProfile

# A layer's qkv rows, or the GEMM that computes them inside the attention call.
QkvRows = torch.Tensor | PanelOperands


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
        started = time.perf_counter() if self.profile is not None else 0.0
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
        return self._attended(layer, started, out)

    def _attended(self, layer: int, started: float, out: torch.Tensor) -> torch.Tensor:
        """Book a layer's attention call that began at ``started``; returns its output."""
        if self.profile is not None:
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            self.profile.add(ATTENTION, time.perf_counter() - started)
        self.layers_called.add(layer)
        return out

    def fused_decode(
        self, rotary: tuple[torch.Tensor, torch.Tensor], q_heads: int, dtype: torch.dtype
    ) -> Callable[[int, QkvRows, float, int | None], torch.Tensor] | None:
        """For a decode-only step on the C kernels: ``attend(layer, qkv, scale, sliding_window)``
        taking the layer's unrotated qkv rows [B, (Hq + 2 Hkv) * D] and doing rotary (``rotary``:
        cos/sin [B, D]), the cache write and attention in one call, returning [B, Hq, D]. ``qkv``
        may also be the qkv projection's panel GEMM
        (engine.model.cpu.linear.StepGemms.fused_operands), which then runs in the same call; the
        profile books its time inside attention's (QKV_IN_ATTENTION). None: use `attend` (another
        backend, or see engine.model.cpu.attention.fused_decode_step)."""
        step = self._fused_step(rotary, q_heads, dtype)
        if step is None:
            return None
        profile = self.profile

        def attend(layer: int, qkv: QkvRows, scale: float, window: int | None) -> torch.Tensor:
            k_cache, v_cache = self.kv_caches[layer]
            started = time.perf_counter() if profile is not None else 0.0
            out = step(qkv, k_cache, v_cache, scale, window, None)
            if profile is not None and not isinstance(qkv, torch.Tensor):
                profile.add(QKV_IN_ATTENTION, step.projection_s)
            return self._attended(layer, started, out)

        return attend

    def decode_layers(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        q_heads: int,
        decoder: NarrowDecoder,
        x: torch.Tensor,
        threads: int,
        logits: bool,
    ) -> NarrowOutput | None:
        """For a decode-only step on the C kernels: every layer of ``decoder`` over ``x``
        [B, hidden] (fp32 embeddings) and the final norm in one call (NarrowDecoder), with
        ``logits`` the lm_head too; the profile books each layer's norm, qkv GEMM and attention
        as its attention call (the GEMM also as QKV_IN_ATTENTION). None, and x untouched: run
        the layers one by one."""
        if x.dtype != torch.float32:
            return None
        step = self._fused_step(rotary, q_heads, x.dtype)
        if step is None:
            return None
        profile = self.profile
        out = decoder(step, self.kv_caches, x, threads, logits, timed=profile is not None)
        if profile is not None:
            for qkv_s, attention_s in out.spans:
                profile.add(ATTENTION, attention_s)
                profile.add(QKV_IN_ATTENTION, qkv_s)
        self.layers_called.update(range(len(self.kv_caches)))
        return out

    def _fused_step(
        self, rotary: tuple[torch.Tensor, torch.Tensor], q_heads: int, dtype: torch.dtype
    ) -> DecodeStep | None:
        """The step's fused decode attention (`fused_decode`), None where it does not apply."""
        if self.backend != "cpu":
            return None
        return fused_decode_step(
            self.meta, self.kv_caches[0][0], rotary, q_heads, dtype, self.profile is not None
        )
