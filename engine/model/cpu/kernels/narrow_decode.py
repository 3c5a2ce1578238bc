"""A decode step's decoder layers on narrow weights in one C call (narrow_decode.c): every layer's
norms, GEMMs (quant_gemm.c) and attention (paged_decode.c) in one parallel region, where a call
per layer and GEMM cost a wake-up of the team per call and the Python between the calls
(docs/PERFORMANCE.md#narrow-weights). `NarrowDecoder` holds the layers' C records, rebuilt only
when a weight moved (parking repoints the tensors)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.model.cpu.kernels.build import load
from engine.model.cpu.kernels.paged_decode import DecodeStep
from engine.model.cpu.kernels.quant_gemm import NarrowLinear
from engine.model.cpu.quant_formats import BLOCK

# Per layer, the seconds narrow_decode.c's thread 0 measures from the layer's start: to the end of
# the qkv GEMM, and of attention.
SPANS = 2


class NarrowGemm(Protocol):
    """A linear on narrow weights (engine.model.cpu.quant_linear.QuantizedLinear)."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    paired: bool

    def narrow(self) -> NarrowLinear: ...


class NarrowLayerWeights(Protocol):
    """One plain pre-norm Llama layer (engine.model.cpu.lean_forward's) on narrow weights: norm
    weights with their eps, the fused qkv and [gate; up] linears."""

    input_norm: tuple[torch.Tensor, float]
    qkv: NarrowGemm
    o_proj: NarrowGemm
    post_norm: tuple[torch.Tensor, float]
    gate_up: NarrowGemm
    down: NarrowGemm
    scale: float
    sliding_window: int | None


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
    ]


class _ActivationsStruct(ctypes.Structure):
    """narrow_decode.c's NarrowActivations."""

    _fields_ = [
        (name, ctypes.c_void_p) for name in ("x", "delta", "qkv", "attn", "o_out", "h", "act")
    ]


class NarrowDecoder:
    """A model's decoder layers on narrow weights for decode-only steps, one C call per step."""

    def __init__(self, lib: ctypes.CDLL, layers: Sequence[NarrowLayerWeights]) -> None:
        """Use `build`, which checks that the C call serves ``layers``."""
        self._lib = lib
        self._layers = tuple(layers)
        first = self._layers[0]
        self.hidden, self.mlp_width = first.o_proj.out_features, first.down.in_features
        self.q_width, self.qkv_width = first.o_proj.in_features, first.qkv.out_features
        # every tensor the records point into: a moved one (a new address) rebuilds them
        self._tensors = tuple(
            t
            for layer in self._layers
            for t in (
                layer.input_norm[0],
                layer.post_norm[0],
                *(part for gemm in _gemms(layer) for part in (gemm.packed, gemm.bias)),
            )
            if t is not None
        )
        self._records: tuple[tuple[int, ...], ctypes.Array] | None = None

    @classmethod
    def build(cls, layers: Sequence[NarrowLayerWeights], qkv_width: int) -> NarrowDecoder | None:
        """The decoder of ``layers`` (their linears all on narrow weights), or None where the C
        call does not serve them: no kernels, an unpaired MLP, norms not fp32, layers of other
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
        if not fits or not all(
            _shape(layer) == shape
            and layer.gate_up.paired
            and all(norm.dtype == torch.float32 for norm, _ in (layer.input_norm, layer.post_norm))
            for layer in layers
        ):
            return None
        return cls(lib, layers)

    def __call__(
        self,
        step: DecodeStep,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        x: torch.Tensor,
        threads: int,
        timed: bool = False,
    ) -> tuple[torch.Tensor, list[tuple[float, float]]]:
        """Every layer of a decode-only step (``step``: its attention, with slots and rotary)
        over ``x`` [B, hidden] (fp32, contiguous: the embeddings), on ``threads`` threads.
        Leaves in x the residual stream before the last layer's MLP output and returns that
        output (the final norm adds it), and with ``timed`` each layer's seconds to the end of
        its qkv GEMM and of its attention (else an empty list)."""
        batch = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.hidden:
            raise ValueError(f"narrow layers take fp32 [B, {self.hidden}] rows, not {x.shape}")
        widths = (self.hidden, self.qkv_width, self.q_width, self.hidden, self.hidden)
        delta, qkv, attn, o_out, h, act = (
            torch.empty((batch, w), dtype=torch.float32) for w in (*widths, self.mlp_width)
        )
        activations = _ActivationsStruct(
            *(t.data_ptr() for t in (x, delta, qkv, attn, o_out, h, act))
        )
        pools = [pool.data_ptr() for kv in kv_caches for pool in kv]
        count = len(self._layers)
        seconds = (ctypes.c_double * (count * SPANS))() if timed else None
        status = self._lib.decode_narrow_layers(
            step.layout, self._records_now(), count, (ctypes.c_void_p * len(pools))(*pools),
            ctypes.byref(activations), threads, seconds,
        )  # fmt: skip
        if status:
            raise MemoryError("the narrow decode layers could not allocate their scratch")
        if seconds is None:
            return delta, []
        return delta, list(zip(seconds[0::SPANS], seconds[1::SPANS], strict=True))

    def _records_now(self) -> ctypes.Array:
        """The layers' C records, rebuilt when a tensor they point into has moved."""
        at = tuple(t.data_ptr() for t in self._tensors)
        if self._records is None or self._records[0] != at:
            records = (_LayerStruct * len(self._layers))(
                *(_record(layer) for layer in self._layers)
            )
            self._records = (at, records)
        return self._records[1]


def _gemms(layer: NarrowLayerWeights) -> tuple[NarrowGemm, ...]:
    return layer.qkv, layer.o_proj, layer.gate_up, layer.down


def _shape(layer: NarrowLayerWeights) -> tuple[int, ...]:
    """(out_features, in_features) of qkv, o_proj, gate_up and down, in that order."""
    return tuple(d for gemm in _gemms(layer) for d in (gemm.out_features, gemm.in_features))


def _record(layer: NarrowLayerWeights) -> _LayerStruct:
    (input_norm, input_eps), (post_norm, post_eps) = layer.input_norm, layer.post_norm
    return _LayerStruct(
        input_norm.data_ptr(), post_norm.data_ptr(), input_eps, post_eps,
        *(gemm.narrow() for gemm in _gemms(layer)), layer.scale, layer.sliding_window or 0,
    )  # fmt: skip
