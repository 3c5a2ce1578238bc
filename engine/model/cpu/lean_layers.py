"""What the lean forward (lean_forward.py) reads off each architecture it runs.

A `Family` per model_type says, as data, how its decoder layer departs from the plain pre-norm
Llama block ``x += o(attn(rope(qkv(norm(x))))); x += down(silu(gate(norm(x))) * up(norm(x)))``;
`decoder_layers` turns a prepared model's layers into `LlamaLayer` records (the block's pieces and
the extras the family adds, None where it has none), so the forward runs only the ops a layer has.
A module that is not the shape its family describes raises `Unsupported`, saying which and why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from engine.model.cpu.linear import FusedMember, PrepackedLinear
from engine.model.cpu.quant_linear import QuantizedEmbedding, QuantizedLinear
from engine.model.skeleton import ScaledEmbedding, activation_kind

# The linears the lean forward runs: prepacked dense ones or narrow-weight ones.
Linear = PrepackedLinear | QuantizedLinear
# An RMSNorm as the fused ops take it: the weight its rows are scaled by, and eps.
Norm = tuple[torch.Tensor, float]

_LLAMA_BLOCK = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})


class Unsupported(TypeError):
    """A model or module the lean forward does not run; the message says which and why."""


@dataclass(frozen=True)
class Family:
    """One architecture's departures from the plain Llama block (the defaults: none).

    No family soft-caps attention scores: Gemma 2 does, and is not one; transformers' Gemma 3
    attention passes no cap, whatever config.attn_logit_softcapping says."""

    layer_children: frozenset[str] = _LLAMA_BLOCK
    # Phi-3's own fused linears (its qkv_proj, its MLP's [gate; up] gate_up_proj); None: separate
    # q/k/v and gate/up projections, which the fast path fuses into one GEMM each
    qkv_proj: str | None = None
    gate_up_proj: str | None = None
    activation: str = "act_fn"  # the MLP's activation module
    qk_norm: bool = False  # per-head RMSNorms of q and k before rope (Qwen3, Gemma 3)
    # Gemma: post_attention_layernorm scales the attention output, pre_feedforward_layernorm is the
    # MLP's input norm and post_feedforward_layernorm scales the MLP output
    sandwich_norms: bool = False
    norm_offset: float = 0.0  # Gemma's RMSNorms scale by (1 + weight)
    # Mistral, Phi-3: config.sliding_window for every layer (their attention modules pass it
    # themselves); the others: the attention module's own sliding_window, set per layer
    window_from_config: bool = False
    scaled_embedding: str | None = None  # an embedding class that scales its rows (Gemma's)


LLAMA = Family()
FAMILIES = {
    "llama": LLAMA,
    "mistral": replace(LLAMA, window_from_config=True),
    "qwen2": LLAMA,
    "qwen3": replace(LLAMA, qk_norm=True),
    "gemma3_text": Family(
        layer_children=_LLAMA_BLOCK | {"pre_feedforward_layernorm", "post_feedforward_layernorm"},
        qk_norm=True,
        sandwich_norms=True,
        norm_offset=1.0,
        scaled_embedding="Gemma3TextScaledWordEmbedding",
    ),
    "phi3": Family(
        layer_children=_LLAMA_BLOCK | {"resid_attn_dropout", "resid_mlp_dropout"},
        qkv_proj="qkv_proj",
        gate_up_proj="gate_up_proj",
        activation="activation_fn",
        window_from_config=True,
    ),
}


@dataclass
class LlamaLayer:
    """The pieces of one decoder layer the lean forward calls: the Llama block's, then the extras
    of the families that have them (None: the layer has none)."""

    input_norm: Norm
    qkv: Linear
    o_proj: Linear
    post_norm: Norm  # the MLP's input norm
    gate_up: Linear
    down: Linear
    scale: float
    sliding_window: int | None
    qk_norm: Norm | None = None  # weights [q heads + kv heads, head_dim]: q's, then k's
    attn_out_norm: Norm | None = None
    mlp_out_norm: Norm | None = None
    activation: nn.Module | None = None  # the model's own, on the gate; None: silu (fused)
    rope: int = 0  # which of the step's rotary tables (Gemma 3: local or global)

    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o_proj, self.gate_up, self.down


def family_of(config: object) -> Family:
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise Unsupported(f"architecture {model_type!r} is not one the lean forward runs")
    return family


def check_embedding(embedding: nn.Module, family: Family) -> None:
    """Plain lookups, or the family's scaled embedding (transformers' or a skeleton's, called as
    it is: it scales itself)."""
    kind = type(embedding)
    scaled = family.scaled_embedding is not None and (
        kind is ScaledEmbedding or kind.__name__ == family.scaled_embedding
    )
    if kind not in (nn.Embedding, QuantizedEmbedding) and not scaled:
        raise Unsupported(f"embedding {kind.__name__} is not a plain lookup")


def decoder_layers(
    layers: nn.ModuleList, family: Family, rope_keys: list[str | None]
) -> list[LlamaLayer]:
    """Every layer's record; ``rope_keys``: the layer types whose rotary tables the forward
    computes per step ([None]: one table for every layer)."""
    return [_layer(index, layer, family, rope_keys) for index, layer in enumerate(layers)]


def _layer(index: int, layer: nn.Module, family: Family, rope_keys: list[str | None]) -> LlamaLayer:
    def refuse(what: str) -> Unsupported:
        return Unsupported(f"layer {index} ({type(layer).__name__}): {what}")

    children = {name for name, _ in layer.named_children()}
    if children != family.layer_children:
        raise refuse(f"submodules {sorted(children)}, not {sorted(family.layer_children)}")
    if any(isinstance(m, nn.Dropout) and m.training and m.p for m in layer.children()):
        raise refuse("dropout in training mode")
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "q_norm") != family.qk_norm:
        raise refuse("q/k norms " + ("missing" if family.qk_norm else "present"))
    qkv = _gemm_of(attn, family.qkv_proj, "q_proj")
    gate_up = _gemm_of(mlp, family.gate_up_proj, "gate_proj")
    if qkv is None or gate_up is None:
        raise refuse("its projections are not fused into one prepacked or narrow GEMM")
    act = getattr(mlp, family.activation, None)
    kind = activation_kind(act)
    if kind is None:
        raise refuse(f"activation {type(act).__name__} is neither silu nor tanh-approximated gelu")
    activation = act if kind == "gelu_tanh" else None
    rope_key = getattr(attn, "layer_type", None) if rope_keys != [None] else None
    if rope_key not in rope_keys:
        raise refuse(f"no rotary table for its layer type {rope_key!r}")
    offset = family.norm_offset
    record = LlamaLayer(
        input_norm=norm_params(layer.input_layernorm, offset),
        qkv=qkv,
        o_proj=_prepacked(attn.o_proj),
        post_norm=norm_params(layer.post_attention_layernorm, offset),
        gate_up=gate_up,
        down=_prepacked(mlp.down_proj),
        scale=float(attn.scaling),
        sliding_window=getattr(
            attn.config if family.window_from_config else attn, "sliding_window", None
        ),
        activation=activation,
        rope=rope_keys.index(rope_key),
    )
    if family.qk_norm:
        record.qk_norm = _head_norms(attn, offset)
    if family.sandwich_norms:
        record.attn_out_norm = record.post_norm
        record.post_norm = norm_params(layer.pre_feedforward_layernorm, offset)
        record.mlp_out_norm = norm_params(layer.post_feedforward_layernorm, offset)
    return record


def _gemm_of(parent: nn.Module, own: str | None, first: str) -> Linear | None:
    """The one GEMM of a projection group: the family's ``own`` fused linear where it has one,
    else the GEMM the fast path fused the group starting at ``first`` into; None if neither."""
    if own is not None:
        module = getattr(parent, own, None)
        return module if isinstance(module, (PrepackedLinear, QuantizedLinear)) else None
    module = getattr(parent, first, None)
    return module.fused.gemm if isinstance(module, FusedMember) else None


def _prepacked(module: nn.Module) -> Linear:
    if not isinstance(module, (PrepackedLinear, QuantizedLinear)):
        raise Unsupported(f"{type(module).__name__} is not prepacked")
    return module


def _head_norms(attn: nn.Module, offset: float) -> Norm:
    """q_norm's and k_norm's weights stacked per head ([Hq + Hkv, head_dim]): one multiply
    scales every q and k head of a row."""
    (q_weight, q_eps), (k_weight, k_eps) = (
        norm_params(n, offset) for n in (attn.q_norm, attn.k_norm)
    )
    if q_eps != k_eps:
        raise Unsupported("q_norm and k_norm have different epsilons")
    q_heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    stacked = torch.cat([q_weight.expand(q_heads, -1), k_weight.expand(kv_heads, -1)])
    return stacked, q_eps


def norm_params(norm: nn.Module, offset: float = 0.0) -> Norm:
    """(weight, eps) of an RMSNorm ``(offset + weight) * x / rms(x)``; the weight itself where
    ``offset`` is 0, else a copy of ``offset + weight`` (computed in fp32, as Gemma does).
    Checked by the runner's probe."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, float):
        raise Unsupported(f"{type(norm).__name__} has no float epsilon")
    weight = norm.weight
    if offset:
        weight = (weight.detach().float() + offset).to(weight.dtype)
    return weight, eps
