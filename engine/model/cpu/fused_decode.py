"""The lean forward's decode-only steps on the C kernel of the "cpu" attention backend: each
layer's rotary, cache write and attention (and its qkv GEMM, where the panel GEMM runs it) as one
call, or on narrow weights every layer and the head as one (`NarrowDecoder`). These are the CPU
fast path's own decode hooks: they read the step's layout and pools from its `StepContext` and
book their calls there like any attention call, so the context stays device-neutral.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.model.cpu.kernels import paged_decode
from engine.model.cpu.kernels.build import available
from engine.model.cpu.kernels.narrow_decode import NarrowDecoder, NarrowOutput
from engine.model.cpu.kernels.panel_gemm import PanelOperands

if TYPE_CHECKING:
    from engine.model.step_context import StepContext

# A layer's qkv rows, or the GEMM that computes them inside the attention call.
QkvRows = torch.Tensor | PanelOperands


class FusedDecode:
    """One decode-only step's attention on the C kernel (built by `fused_decode`)."""

    def __init__(self, ctx: StepContext, step: paged_decode.DecodeStep) -> None:
        self._ctx = ctx
        self._step = step

    def attend(
        self, layer: int, qkv: QkvRows, scale: float, sliding_window: int | None
    ) -> torch.Tensor:
        """Rotary, cache write and attention of ``layer`` in one call, on its unrotated qkv rows
        [B, (Hq + 2 Hkv) * D], or on the qkv projection's panel GEMM
        (engine.model.cpu.linear.StepGemms.fused_operands), which then runs in the same call and
        is booked inside attention's time (QKV_IN_ATTENTION); returns [B, Hq, D]."""
        k_cache, v_cache = self._ctx.kv_caches[layer]
        started = self._ctx.clock()
        out = self._step(qkv, k_cache, v_cache, scale, sliding_window, None)
        projected = None if isinstance(qkv, torch.Tensor) else self._step.projection_s
        return self._ctx.attended(layer, started, out, projected)

    def all_layers(
        self,
        decoder: NarrowDecoder,
        x: torch.Tensor,
        threads: int,
        logits: bool,
        rotary: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> NarrowOutput | None:
        """Every layer of ``decoder`` over ``x`` [B, hidden] (fp32 embeddings) and the final norm
        in one call, with ``logits`` the lm_head too; ``rotary``: the step's rotary tables (cos/sin
        [B, head_dim]), of which each layer's record picks one. Each layer's norm, qkv GEMM and
        attention is booked as its attention call (the GEMM also as QKV_IN_ATTENTION). None, and x
        untouched, for other activations: run the layers one by one."""
        if x.dtype != torch.float32:
            return None
        timed = self._ctx.profile is not None
        out = decoder(self._step, self._ctx.kv_caches, x, threads, logits, rotary, timed=timed)
        self._ctx.attended_all(out.spans)
        return out


def fused_decode(
    ctx: StepContext, rotary: tuple[torch.Tensor, torch.Tensor], q_heads: int, dtype: torch.dtype
) -> FusedDecode | None:
    """The step's fused decode attention, for a decode-only step of the "cpu" backend where the
    kernel serves it (fp32 or bf16 activations and CPU pools, every slot inside the pools); None:
    the caller rotates q/k and attends through ``ctx.attend``. rotary: cos/sin [B, head_dim] of
    the step's tokens (rotate-half convention, as engine.model.cpu.kernels.fused_ops.FusedOps.rope
    takes them). While profiling, the calls that run the qkv projection also time it."""
    meta, k_cache = ctx.meta, ctx.kv_caches[0][0]
    if (
        ctx.backend != "cpu"
        or not meta.is_decode_only
        or dtype not in (torch.float32, torch.bfloat16)
        or k_cache.device.type != "cpu"
        or k_cache.dtype not in (torch.float32, torch.bfloat16)
        or not available()
        or not meta.slots_within(k_cache.shape[0] * k_cache.shape[1])
    ):
        return None
    _, block_size, kv_heads, head_dim = k_cache.shape
    visible = sum(meta.seq_lens_cpu)  # sizes the thread count; a sliding window only shrinks it
    step = paged_decode.DecodeStep(
        meta.block_tables,
        meta.seq_lens,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        kv_dtype=k_cache.dtype,
        num_threads=paged_decode.decode_threads(visible * q_heads * head_dim),
        act_dtype=dtype,
        slots=meta.slot_mapping,
        rotary=rotary,
        time_projection=ctx.profile is not None,
    )
    return FusedDecode(ctx, step)
