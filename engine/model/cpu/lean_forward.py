"""A lean forward for Llama-family decoders on the CPU fast path.

transformers' eager forward spends more time in per-op dispatch and Python (views, transposes,
hooks, the attention interface, rotary helpers) than SmolLM2's small layers spend computing
(figures: docs/PERFORMANCE.md#per-op-overhead). For the architectures whose layer is the plain
pre-norm Llama block, or departs from it only in the ways engine.model.cpu.lean_layers lists per
family (Qwen3's q/k norms; Gemma 3's q/k norms, sandwich norms, (1 + w) scales, GeGLU, scaled
embedding, local and global rotary tables and final logit soft-cap; Phi-3's own fused linears),
this module runs the same math with a fixed, minimal op sequence over the model's own (prepacked,
fused) weights: each layer runs only the ops its record has.

It is an optimisation, never a second source of truth: the runner checks it against the
transformers forward on a probe batch at load and keeps the transformers path when they differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.cpu.fused_decode import fused_decode
from engine.model.cpu.kernels.fused_ops import FusedOps, StepOps
from engine.model.cpu.kernels.narrow_decode import NarrowDecoder
from engine.model.cpu.lean_layers import (
    Linear,
    LlamaLayer,
    Norm,
    Unsupported,
    check_embedding,
    decoder_layers,
    family_of,
    norm_params,
)
from engine.model.cpu.linear import PrepackedLinear, StepGemms
from engine.model.cpu.quant_linear import QuantizedEmbedding, QuantizedLinear

if TYPE_CHECKING:
    from engine.model.step_context import StepContext

__all__ = ["LeanLlamaForward", "LlamaLayer"]

log = logging.getLogger(__name__)


class LeanLlamaForward:
    """Runs a supported causal LM over the flattened batch; same inputs and logits as the
    transformers path of engine.model.runner."""

    def __init__(self, model: nn.Module) -> None:
        """Raises `Unsupported` (or AttributeError, for a module it lacks) where the model is not
        one the lean forward runs."""
        config = model.config.get_text_config()
        family = family_of(config)
        if not isinstance(getattr(model, "lm_head", None), (PrepackedLinear, QuantizedLinear)):
            raise Unsupported("its lm_head is neither prepacked nor narrow")
        inner = model.model
        check_embedding(inner.embed_tokens, family)
        self.embed: nn.Embedding | QuantizedEmbedding = inner.embed_tokens
        dtype = getattr(self.embed, "dtype", None) or self.embed.weight.dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = inner.layers[0].self_attn.head_dim
        # one rotary table per layer type where the module keeps one each (Gemma 3: local, global)
        types = getattr(inner.rotary_emb, "layer_types", None)
        rope_keys: list[str | None] = list(types) if types else [None]
        self.rotaries = [_rotary_of(inner.rotary_emb, key) for key in rope_keys]
        # the fused rope rotates whole heads (Phi-3's partial_rotary_factor leaves part as it is)
        probe = torch.zeros(1, dtype=dtype, device=inner.norm.weight.device)
        if any(r(probe, probe.long())[0].shape[-1] != self.head_dim for r in self.rotaries):
            raise Unsupported("its rotary embedding covers part of each head only")
        self.final_norm = norm_params(inner.norm, family.norm_offset)
        self.final_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.lm_head: Linear = model.lm_head
        self.layers = decoder_layers(inner.layers, family, rope_keys)
        self.mlp_width = self.layers[0].down.in_features
        # decode steps on narrow weights: every layer in one C call (NarrowDecoder.build refuses
        # what the kernel does not run)
        self.narrow: NarrowDecoder | None = None
        if all(isinstance(m, QuantizedLinear) for layer in self.layers for m in layer.linears()):
            qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            lm_head = self.lm_head if isinstance(self.lm_head, QuantizedLinear) else None
            self.narrow = NarrowDecoder.build(self.layers, qkv_width, self.final_norm, lm_head)
        self.ops = FusedOps(dtype, self.final_norm[0].device)

    @classmethod
    def build(cls, model: nn.Module) -> LeanLlamaForward | None:
        """The lean forward of ``model``, or None (logged, with the reason) when its structure is
        not one the lean forward runs."""
        try:
            return cls(model)
        except (AttributeError, TypeError) as exc:  # Unsupported, or a module it lacks
            name = type(model).__name__
            log.info("lean forward not built for %s: %s; the transformers forward runs", name, exc)
            return None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: StepContext,
        sample_rows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Fill the KV cache for every token; logits of ``sample_rows`` (None: no logits).
        ``attention`` is the runner's paged attention of this step (it owns caches and metadata)."""
        ops = self.ops
        # [T, hidden], a fresh tensor: the residual stream, which the norms update in place
        x = self.embed(input_ids)
        tables = [ops.rotary_tables(*rotary(x, positions)) for rotary in self.rotaries]
        tokens = x.shape[0]
        q_width = self.num_heads * self.head_dim
        qk_heads = self.num_heads + self.num_kv_heads
        gemms = StepGemms(tokens)
        # decode steps on the C kernels (rotary is in their form): on narrow weights one call for
        # every layer (which takes every rotary table), else one per layer for rope + write +
        # attend (one step per rotary table); whether the kernel serves the step does not depend
        # on the table
        first = (
            fused_decode(attention, tables[0], self.num_heads, x.dtype)
            if ops.uses_kernels
            else None
        )
        if first is not None and self.narrow is not None:
            # every row sampled (a decode step's rows are its samples): the logits in the call
            every_row = sample_rows is not None and len(sample_rows) == tokens
            out = first.all_layers(self.narrow, x, gemms.threads, every_row, tables)
            if out is not None:
                if sample_rows is None:
                    return None
                if out.logits is not None:
                    return self._capped(out.logits)
                return self._capped(self.lm_head(out.hidden.index_select(0, sample_rows)))
        fused = None
        if first is not None:
            rest = (fused_decode(attention, t, self.num_heads, x.dtype) for t in tables[1:])
            fused = [first, *rest]
        delta = None  # the previous block's output, added to x by the next norm
        step_ops = StepOps(ops, x, self.mlp_width)
        for index, layer in enumerate(self.layers):
            h = step_ops.add_rms_norm(delta, *layer.input_norm)
            if layer.qk_norm is not None:  # q and k normed before rope: no projection in the call
                qkv = gemms(layer.qkv, h)
                _norm_heads(qkv, layer.qk_norm, qk_heads, self.head_dim)
            elif fused is not None:  # with the projection where the kernel can run it too
                qkv = gemms.fused_operands(layer.qkv, h) or gemms(layer.qkv, h)
            else:
                qkv = gemms(layer.qkv, h)
            if fused is not None:
                attn = fused[layer.rope].attend(index, qkv, layer.scale, layer.sliding_window)
            else:
                qk = ops.rope(qkv, tables[layer.rope], qk_heads, self.head_dim)
                v = qkv[:, qk_heads * self.head_dim :].view(tokens, self.num_kv_heads, -1)
                attn = attention.attend(
                    index,
                    qk[:, : self.num_heads],
                    qk[:, self.num_heads :],
                    v,
                    layer.scale,
                    layer.sliding_window,
                    None,
                )
            attn = attn.reshape(tokens, q_width)
            out = gemms(layer.o_proj, attn)
            if layer.attn_out_norm is not None:
                out = ops.add_rms_norm(out, None, *layer.attn_out_norm)
            h = step_ops.add_rms_norm(out, *layer.post_norm)
            if layer.activation is None:
                act = gemms.silu_mul(layer.gate_up, h, step_ops.silu_mul)
            else:
                gate_up = gemms(layer.gate_up, h)
                width = gate_up.shape[1] // 2
                act = layer.activation(gate_up[:, :width]).mul_(gate_up[:, width:])
            delta = gemms(layer.down, act)
            if layer.mlp_out_norm is not None:
                delta = ops.add_rms_norm(delta, None, *layer.mlp_out_norm)
        if sample_rows is None:
            return None
        rows = x.index_select(0, sample_rows)  # a copy: the norm's in-place add stays local
        h = ops.add_rms_norm(rows, delta.index_select(0, sample_rows), *self.final_norm)
        return self._capped(self.lm_head(h))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits soft-capped where the model caps them (Gemma: ``c * tanh(logits / c)``)."""
        cap = self.final_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap).mul_(cap)


def _norm_heads(qkv: torch.Tensor, norm: Norm, heads: int, head_dim: int) -> None:
    """RMSNorm in place of each of the first ``heads`` heads of every row of qkv [T, W], head h
    scaled by row h of the stacked weight [heads, head_dim]."""
    weight, eps = norm
    qk = qkv[:, : heads * head_dim].view(qkv.shape[0], heads, head_dim)
    torch.mul(F.rms_norm(qk, (head_dim,), None, eps), weight, out=qk)


class _RotaryTable:
    """transformers' cos/sin per position, computed by the model's own rotary module once for
    positions [0, n) (n doubling on demand) and gathered per step: a decode step's rotary went from
    the module's ~10 ops to two index_selects (docs/PERFORMANCE.md#per-op-overhead). Only for
    rotary types whose angles depend on the position alone (not "dynamic"/"longrope", which
    rescale with the batch's length). The module computes each position independently, so the
    values are its own (up to the last bit where torch's scalar remainder loop and its vector
    lanes round a cos differently)."""

    def __init__(self, compute: Callable[[torch.Tensor, torch.Tensor], tuple]) -> None:
        """``compute``: the module's call, ``(x, position_ids [1, n]) -> (cos, sin) [1, n, D]``."""
        self.compute = compute
        self.cos = self.sin = torch.empty(0)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, head_dim] in x's dtype for positions [T]."""
        needed = int(positions.max()) + 1
        if needed > len(self.cos) or self.cos.dtype != x.dtype:
            size = max(256, 1 << (needed - 1).bit_length())
            every = torch.arange(size, device=x.device)[None]
            cos, sin = self.compute(x, every)
            self.cos, self.sin = cos[0], sin[0]
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def _rotary_of(
    module: nn.Module, layer_type: str | None = None
) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """``(x, positions [T]) -> (cos, sin) [T, head_dim]`` of the model's rotary module; with
    ``layer_type``, of that layer type's table (a module that keeps one per type: Gemma 3)."""
    rope_type = getattr(module, "rope_type", "default")
    if layer_type is None:
        compute = module
    else:
        if layer_type not in rope_type:
            raise Unsupported(f"no rotary parameters for its layer type {layer_type!r}")
        rope_type = rope_type[layer_type]

        def compute(x: torch.Tensor, position_ids: torch.Tensor) -> tuple:
            return module(x, position_ids, layer_type)

    if "dynamic" in str(rope_type) or rope_type == "longrope":
        return lambda x, positions: tuple(t[0] for t in compute(x, positions[None]))
    return _RotaryTable(compute)
