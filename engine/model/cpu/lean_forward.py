"""A lean forward for Llama-family decoders on the CPU fast path.

transformers' eager forward spends more time in per-op dispatch and Python (views, transposes,
hooks, the attention interface, rotary helpers) than SmolLM2's small layers spend computing
(figures: docs/PERFORMANCE.md#per-op-overhead). For the architectures whose layer is exactly
``x += o(attn(rope(qkv(norm(x))))); x += down(silu(gate(norm(x))) * up(norm(x)))`` this module runs
the same math with a fixed, minimal op sequence over the model's own (prepacked, fused) weights.

It is an optimisation, never a second source of truth: the runner checks it against the
transformers forward on a probe batch at load and keeps the transformers path when they differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model.cpu.fused_decode import fused_decode
from engine.model.cpu.kernels.fused_ops import FusedOps, StepOps
from engine.model.cpu.kernels.narrow_decode import NarrowDecoder
from engine.model.cpu.linear import FusedMember, PrepackedLinear, StepGemms
from engine.model.cpu.quant_linear import QuantizedEmbedding, QuantizedLinear

if TYPE_CHECKING:
    from engine.model.step_context import StepContext


# The linears the lean forward runs: prepacked dense ones or narrow-weight ones.
Linear = PrepackedLinear | QuantizedLinear
# Architectures whose decoder layer is the plain pre-norm Llama block (with or without q/k/v bias).
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# That block's submodules: Gemma 2/3 add pre/post feed-forward norms, and their post-attention
# norm scales the attention output instead of the MLP input.
_LLAMA_BLOCK = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})


@dataclass
class LlamaLayer:
    """The pieces of one decoder layer the lean forward calls."""

    input_norm: tuple[torch.Tensor, float]
    qkv: Linear
    o_proj: Linear
    post_norm: tuple[torch.Tensor, float]
    gate_up: Linear
    down: Linear
    scale: float
    sliding_window: int | None


class LeanLlamaForward:
    """Runs a supported causal LM over the flattened batch; same inputs and logits as the
    transformers path of engine.model.runner."""

    def __init__(self, model: nn.Module) -> None:
        inner = model.model
        config = model.config
        # not e.g. Gemma's, scaled by sqrt(hidden)
        if type(inner.embed_tokens) not in (nn.Embedding, QuantizedEmbedding):
            raise TypeError("not a plain embedding")
        self.embed: nn.Embedding | QuantizedEmbedding = inner.embed_tokens
        self.rotary = _rotary_of(inner.rotary_emb)
        self.final_norm = _norm_params(inner.norm)
        self.lm_head: Linear = model.lm_head
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.layers = [_layer(layer) for layer in inner.layers]
        self.mlp_width = self.layers[0].down.in_features
        # decode steps on narrow weights: every layer in one C call
        self.narrow: NarrowDecoder | None = None
        if all(isinstance(m, QuantizedLinear) for layer in self.layers for m in _linears(layer)):
            qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            lm_head = self.lm_head if isinstance(self.lm_head, QuantizedLinear) else None
            self.narrow = NarrowDecoder.build(self.layers, qkv_width, self.final_norm, lm_head)
        dtype = getattr(self.embed, "dtype", None) or self.embed.weight.dtype
        self.ops = FusedOps(dtype, self.final_norm[0].device)

    @classmethod
    def build(cls, model: nn.Module) -> LeanLlamaForward | None:
        """The lean forward of ``model``, or None when its structure is not the supported one."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return None
        if getattr(config, "hidden_act", None) != "silu" or not isinstance(
            getattr(model, "lm_head", None), (PrepackedLinear, QuantizedLinear)
        ):
            return None
        try:
            return cls(model)
        except (AttributeError, TypeError):  # a variant with other modules than the plain block
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
        rotary = ops.rotary_tables(*self.rotary(x, positions))
        tokens = x.shape[0]
        q_width = self.num_heads * self.head_dim
        qk_heads = self.num_heads + self.num_kv_heads
        gemms = StepGemms(tokens)
        # decode steps on the C kernels (rotary is in their form): one call per layer for rope +
        # write + attend, or on narrow weights one call for every layer
        fused = (
            fused_decode(attention, rotary, self.num_heads, x.dtype) if ops.uses_kernels else None
        )
        if fused is not None and self.narrow is not None:
            # every row sampled (a decode step's rows are its samples): the logits in the call
            every_row = sample_rows is not None and len(sample_rows) == tokens
            out = fused.all_layers(self.narrow, x, gemms.threads, every_row)
            if out is not None:
                if sample_rows is None:
                    return None
                if out.logits is not None:
                    return out.logits
                return self.lm_head(out.hidden.index_select(0, sample_rows))
        delta = None  # the previous block's output, added to x by the next norm
        step_ops = StepOps(ops, x, self.mlp_width)
        for index, layer in enumerate(self.layers):
            h = step_ops.add_rms_norm(delta, *layer.input_norm)
            if fused is not None:  # with the projection where the kernel can run it too
                qkv = gemms.fused_operands(layer.qkv, h) or gemms(layer.qkv, h)
                attn = fused.attend(index, qkv, layer.scale, layer.sliding_window)
            else:
                qkv = gemms(layer.qkv, h)
                qk = ops.rope(qkv, rotary, qk_heads, self.head_dim)
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
            h = step_ops.add_rms_norm(gemms(layer.o_proj, attn), *layer.post_norm)
            delta = gemms(layer.down, gemms.silu_mul(layer.gate_up, h, step_ops.silu_mul))
        if sample_rows is None:
            return None
        rows = x.index_select(0, sample_rows)  # a copy: the norm's in-place add stays local
        h = ops.add_rms_norm(rows, delta.index_select(0, sample_rows), *self.final_norm)
        return self.lm_head(h)


class _RotaryTable:
    """transformers' cos/sin per position, computed by the model's own rotary module once for
    positions [0, n) (n doubling on demand) and gathered per step: a decode step's rotary went from
    the module's ~10 ops to two index_selects (docs/PERFORMANCE.md#per-op-overhead). Only for
    rotary types whose angles
    depend on the position alone (not "dynamic"/"longrope", which rescale with the batch's length).
    The module computes each position independently, so the values are its own (up to the last
    bit where torch's scalar remainder loop and its vector lanes round a cos differently)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.cos = self.sin = torch.empty(0)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, head_dim] in x's dtype for positions [T]."""
        needed = int(positions.max()) + 1
        if needed > len(self.cos) or self.cos.dtype != x.dtype:
            size = max(256, 1 << (needed - 1).bit_length())
            every = torch.arange(size, device=x.device)[None]
            cos, sin = self.module(x, every)
            self.cos, self.sin = cos[0], sin[0]
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def _rotary_of(module: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """``(x, positions [T]) -> (cos, sin) [T, head_dim]`` of the model's rotary module."""
    rope_type = str(getattr(module, "rope_type", "default"))
    if "dynamic" in rope_type or rope_type == "longrope":
        return lambda x, positions: tuple(t[0] for t in module(x, positions[None]))
    return _RotaryTable(module)


def _layer(layer: nn.Module) -> LlamaLayer:
    if {name for name, _ in layer.named_children()} != _LLAMA_BLOCK:
        raise TypeError("not the plain Llama block")
    attn, mlp = layer.self_attn, layer.mlp
    if not all(isinstance(m, FusedMember) for m in (attn.q_proj, mlp.gate_proj)):
        raise TypeError("projections are not fused")
    if hasattr(attn, "q_norm") or type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        raise TypeError("not the plain Llama block")
    return LlamaLayer(
        input_norm=_norm_params(layer.input_layernorm),
        qkv=attn.q_proj.fused.gemm,
        o_proj=_prepacked(attn.o_proj),
        post_norm=_norm_params(layer.post_attention_layernorm),
        gate_up=mlp.gate_proj.fused.gemm,
        down=_prepacked(mlp.down_proj),
        scale=float(attn.scaling),
        sliding_window=getattr(attn, "sliding_window", None),
    )


def _linears(layer: LlamaLayer) -> tuple[Linear, ...]:
    return layer.qkv, layer.o_proj, layer.gate_up, layer.down


def _prepacked(module: nn.Module) -> Linear:
    if not isinstance(module, (PrepackedLinear, QuantizedLinear)):
        raise TypeError(f"{type(module).__name__} is not prepacked")
    return module


def _norm_params(norm: nn.Module) -> tuple[torch.Tensor, float]:
    """(weight, eps) of a plain RMSNorm (``weight * x / rms(x)``); checked by the runner's probe."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, float):
        raise TypeError(f"{type(norm).__name__} has no float epsilon")
    return norm.weight, eps
