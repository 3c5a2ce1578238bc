"""A decode step's decoder layers on narrow weights in one C call (narrow_decode.c): every layer's
norms, GEMMs (quant_gemm.c) and attention (paged_decode.c), then the final norm and the lm_head,
in one parallel region, where a call per layer and GEMM cost a wake-up of the team per call and
the Python between the calls (docs/PERFORMANCE.md#narrow-weights). The layers may carry the
lean forward's extras (engine.model.cpu.lean_layers: Qwen3's and Gemma 3's q/k norms, Gemma 3's
sandwich norms, GeGLU and local / global rotary tables). `NarrowDecoder` holds the layers' C
records, rebuilt only when a weight moved (parking repoints the tensors)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from engine.model.cpu.kernels.build import load
from engine.model.cpu.kernels.paged_decode import DecodeStep
from engine.model.cpu.kernels.quant_gemm import NarrowLinear
from engine.model.cpu.quant_formats import BLOCK

# Per layer, the seconds narrow_decode.c's thread 0 measures from the layer's start: to the end of
# the qkv GEMM (and q/k norms), and of attention.
SPANS = 2
# quant_gemm.h's activation codes of the gated MLP
_ACT_SILU, _ACT_GELU_TANH = 0, 1


class NarrowGemm(Protocol):
    """A linear on narrow weights (engine.model.cpu.quant_linear.QuantizedLinear)."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    paired: bool

    def narrow(self) -> NarrowLinear: ...


class NarrowLayerWeights(Protocol):
    """One pre-norm Llama layer (engine.model.cpu.lean_layers.LlamaLayer) on narrow weights: norm
    weights with their eps, the fused qkv and [gate; up] linears, and the extras (None: absent):
    q/k head norms [Hq + Hkv, head_dim], the o and down outputs' norms, the gate's activation
    (None: silu; else the tanh-approximated gelu, the only other one lean_layers accepts) and the
    index of the step's rotary table."""

    input_norm: tuple[torch.Tensor, float]
    qkv: NarrowGemm
    o_proj: NarrowGemm
    post_norm: tuple[torch.Tensor, float]
    gate_up: NarrowGemm
    down: NarrowGemm
    scale: float
    sliding_window: int | None
    qk_norm: tuple[torch.Tensor, float] | None
    attn_out_norm: tuple[torch.Tensor, float] | None
    mlp_out_norm: tuple[torch.Tensor, float] | None
    activation: object | None
    rope: int


class _LayerStruct(ctypes.Structure):
    """narrow_decode.c's NarrowLayer."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("input_eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
        ("qkv", NarrowLinear),
        ("o", NarrowLinear),
        ("gate_up", NarrowLinear),
        ("down", NarrowLinear),
        ("scale", ctypes.c_float),
        ("window", ctypes.c_int64),
        ("qk_norm", ctypes.c_void_p),
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("qk_eps", ctypes.c_float),
        ("attn_out_eps", ctypes.c_float),
        ("mlp_out_eps", ctypes.c_float),
        ("activation", ctypes.c_int),
        ("rope", ctypes.c_int),
    ]


class _HeadStruct(ctypes.Structure):
    """narrow_decode.c's NarrowHead."""

    _fields_ = [("norm", ctypes.c_void_p), ("eps", ctypes.c_float), ("lm_head", NarrowLinear)]


_ACTIVATIONS = ("x", "delta", "qkv", "attn", "o_out", "h", "act", "logits")


class _ActivationsStruct(ctypes.Structure):
    """narrow_decode.c's NarrowActivations: the step's buffers, then its rotary tables."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in _ACTIVATIONS),
        ("rotary", ctypes.c_void_p),
        ("tables", ctypes.c_int64),
    ]


class NarrowOutput(NamedTuple):
    """A decode step's end: the final norm's rows [B, hidden], the logits [B, vocabulary] (None
    unless asked for and the lm_head is narrow) and, when timed, each layer's seconds to the end
    of its qkv GEMM and of its attention."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    spans: list[tuple[float, float]]


class NarrowDecoder:
    """A model's decoder layers, final norm and (on narrow weights) lm_head for decode-only
    steps, one C call per step."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        layers: Sequence[NarrowLayerWeights],
        final_norm: tuple[torch.Tensor, float],
        lm_head: NarrowGemm | None,
    ) -> None:
        """Use `build`, which checks that the C call serves ``layers``."""
        self._lib = lib
        self._layers = tuple(layers)
        self._final_norm = final_norm
        self._lm_head = lm_head
        first = self._layers[0]
        self.hidden, self.mlp_width = first.o_proj.out_features, first.down.in_features
        self.q_width, self.qkv_width = first.o_proj.in_features, first.qkv.out_features
        # every tensor the records point into: a moved one (a new address) rebuilds them
        gemms = [gemm for layer in self._layers for gemm in _gemms(layer)]
        gemms += [lm_head] if lm_head is not None else []
        norms = [norm for layer in self._layers for norm, _ in _norms(layer)]
        self.tables = 1 + max(layer.rope for layer in self._layers)
        self._tensors = tuple(
            t
            for t in (*norms, final_norm[0], *(p for g in gemms for p in (g.packed, g.bias)))
            if t is not None
        )
        self._records: tuple[tuple[int, ...], ctypes.Array, _HeadStruct] | None = None

    @property
    def has_lm_head(self) -> bool:
        """Whether the call can return the logits (the lm_head is on narrow weights)."""
        return self._lm_head is not None

    @classmethod
    def build(
        cls,
        layers: Sequence[NarrowLayerWeights],
        qkv_width: int,
        final_norm: tuple[torch.Tensor, float],
        lm_head: NarrowGemm | None,
    ) -> NarrowDecoder | None:
        """The decoder of ``layers`` (their linears all on narrow weights) and the model's head
        (``lm_head``: None where it is not on narrow weights, or one of another input width: the
        caller runs it), or None where the C call does not serve them: no kernels, an unpaired
        MLP, norms not fp32 (or q/k norms not one weight per q and k head), layers of other
        widths, or a width the kernel's int8 blocks (quant_formats.BLOCK) do not divide.
        ``qkv_width``: (Hq + 2 Hkv) * head_dim, as the attention reads the qkv rows."""
        lib = load()
        if lib is None or not layers:
            return None
        shape = _shape(layers[0])
        qkv_out, hidden, o_out, q_width, gate_up_out, gate_up_in, down_out, width = shape
        fits = (
            qkv_out == qkv_width
            and o_out == gate_up_in == down_out == hidden
            and gate_up_out == 2 * width
            and not any(w % BLOCK for w in (hidden, q_width, width))
        )
        norms = [final_norm[0], *(n for layer in layers for n, _ in _norms(layer))]
        # q/k norms: a weight per q and k head, (Hq + Hkv) * head_dim, q's and half the rest
        qk_size = q_width + (qkv_out - q_width) // 2
        if (
            not fits
            or any(
                layer.qk_norm is not None and layer.qk_norm[0].numel() != qk_size
                for layer in layers
            )
            or not all(_shape(layer) == shape and layer.gate_up.paired for layer in layers)
            or any(norm.dtype != torch.float32 or not norm.is_contiguous() for norm in norms)
            or any(layer.rope < 0 for layer in layers)
        ):
            return None
        if lm_head is not None and lm_head.in_features != hidden:
            lm_head = None
        return cls(lib, layers, final_norm, lm_head)

    def __call__(
        self,
        step: DecodeStep,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        x: torch.Tensor,
        threads: int,
        logits: bool,
        rotary: Sequence[tuple[torch.Tensor, torch.Tensor]],
        timed: bool = False,
    ) -> NarrowOutput:
        """Every layer of a decode-only step (``step``: its attention, with slots) over ``x`` [B,
        hidden] (fp32, contiguous: the embeddings), then the final norm, and with ``logits`` (and
        `has_lm_head`) the lm_head, on ``threads`` threads. ``rotary``: the step's rotary tables,
        cos/sin [B, head_dim] each (at least `tables` of them: a layer's ``rope`` picks one).
        Leaves in x the residual stream after the last layer."""
        batch = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.hidden:
            raise ValueError(f"narrow layers take fp32 [B, {self.hidden}] rows, not {x.shape}")
        if len(rotary) < self.tables:
            raise ValueError(f"the layers take {self.tables} rotary tables, not {len(rotary)}")
        # fp32 and contiguous, as the kernel reads them (no copy when they are already)
        tables = [t.float().contiguous() for table in rotary for t in table]
        widths = (self.hidden, self.qkv_width, self.q_width, self.hidden, self.hidden)
        delta, qkv, attn, o_out, h, act = (
            torch.empty((batch, w), dtype=torch.float32) for w in (*widths, self.mlp_width)
        )
        out = None
        if logits and self._lm_head is not None:
            out = torch.empty((batch, self._lm_head.out_features), dtype=torch.float32)
        rotary_ptrs = (ctypes.c_void_p * len(tables))(*(t.data_ptr() for t in tables))
        activations = _ActivationsStruct(
            *(t.data_ptr() for t in (x, delta, qkv, attn, o_out, h, act)),
            None if out is None else out.data_ptr(),
            ctypes.cast(rotary_ptrs, ctypes.c_void_p),
            len(rotary),
        )
        pools = [pool.data_ptr() for kv in kv_caches for pool in kv]
        count = len(self._layers)
        seconds = (ctypes.c_double * (count * SPANS))() if timed else None
        layers, head = self._records_now()
        status = self._lib.decode_narrow_layers(
            step.layout, layers, count, ctypes.byref(head), (ctypes.c_void_p * len(pools))(*pools),
            ctypes.byref(activations), threads, seconds,
        )  # fmt: skip
        if status:
            raise MemoryError("the narrow decode layers could not allocate their scratch")
        spans = (
            [] if seconds is None else list(zip(seconds[0::SPANS], seconds[1::SPANS], strict=True))
        )
        return NarrowOutput(h, out, spans)

    def _records_now(self) -> tuple[ctypes.Array, _HeadStruct]:
        """The layers' and the head's C records, rebuilt when a tensor they point into has
        moved."""
        at = tuple(t.data_ptr() for t in self._tensors)
        if self._records is None or self._records[0] != at:
            layers = (_LayerStruct * len(self._layers))(*(_record(layer) for layer in self._layers))
            norm, eps = self._final_norm
            lm_head = self._lm_head.narrow() if self._lm_head is not None else NarrowLinear()
            self._records = (at, layers, _HeadStruct(norm.data_ptr(), eps, lm_head))
        return self._records[1], self._records[2]


def _gemms(layer: NarrowLayerWeights) -> tuple[NarrowGemm, ...]:
    return layer.qkv, layer.o_proj, layer.gate_up, layer.down


def _shape(layer: NarrowLayerWeights) -> tuple[int, ...]:
    """(out_features, in_features) of qkv, o_proj, gate_up and down, in that order."""
    return tuple(d for gemm in _gemms(layer) for d in (gemm.out_features, gemm.in_features))


def _norms(layer: NarrowLayerWeights) -> tuple[tuple[torch.Tensor, float], ...]:
    """The layer's norms: input and post, then those of the extras it has."""
    extras = (layer.qk_norm, layer.attn_out_norm, layer.mlp_out_norm)
    return layer.input_norm, layer.post_norm, *(n for n in extras if n is not None)


def _extra(norm: tuple[torch.Tensor, float] | None) -> tuple[int | None, float]:
    """An optional norm as the C record takes it: its weight's address (NULL: none) and eps."""
    return (None, 0.0) if norm is None else (norm[0].data_ptr(), norm[1])


def _record(layer: NarrowLayerWeights) -> _LayerStruct:
    (input_norm, input_eps), (post_norm, post_eps) = layer.input_norm, layer.post_norm
    (qk, qk_eps), (attn_out, attn_out_eps), (mlp_out, mlp_out_eps) = (
        _extra(n) for n in (layer.qk_norm, layer.attn_out_norm, layer.mlp_out_norm)
    )
    activation = _ACT_SILU if layer.activation is None else _ACT_GELU_TANH
    return _LayerStruct(
        input_norm.data_ptr(), post_norm.data_ptr(), input_eps, post_eps,
        *(gemm.narrow() for gemm in _gemms(layer)), layer.scale, layer.sliding_window or 0,
        qk, attn_out, mlp_out, qk_eps, attn_out_eps, mlp_out_eps, activation, layer.rope,
    )  # fmt: skip
