"""Putting a loaded model's linears and embedding on narrow weights (``--quantization``).

Where each weight comes from: a GGUF tensor whose blocks a format holds exactly
(engine.model.cpu.quant_formats.GGUF_BLOCKS) loads as it is, from the file's blocks in the row
order transformers gives it (engine.model.cpu.gguf_weights); any other weight of a quantizable
shape is quantised from its fp32 values. ``gguf`` mode (the default for GGUF files) takes only
the first kind and leaves the rest dense; ``int8`` / ``int4`` put every linear in that format (a
Q8_0 weight as the file's blocks, in int8h: int8 with fp16 scales), except that int4 keeps the
embedding and lm_head in int8 (as llama.cpp's quantiser keeps its
output tensor at 6 bits or more: in int4 SmolLM2's top token changed on half of the load probe).
q/k/v and gate/up fuse into one GEMM each, as on the dense path (parts of mixed formats in the
narrowest format that holds each exactly: int8k holds every one but Q2_K's int2k, int8km all); an
embedding tied to a narrow lm_head reads its rows from the head.

engine.model.cpu.narrow_weights checks the result against the dense forward on a probe, as the
lean forward is checked: a format that moves the model's predictions too far is refused.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.model.cache_dir import wait_for_writes, write_behind
from engine.model.cpu import narrow_cache, packed_cache
from engine.model.cpu.linear import fuse_groups, own_gate_up, stacked_bias
from engine.model.cpu.narrow_cache import Choice
from engine.model.cpu.packed_cache import MappedFile, PackedSlots
from engine.model.cpu.quant_formats import (
    NARROWER,
    QuantizedWeight,
    concatenate,
    quantizable,
    quantize,
)
from engine.model.cpu.quant_linear import QuantizedEmbedding, QuantizedLinear

MODES = ("gguf", "int8", "int4")

# A parameter's blocks as the file holds them, by its names (several when tied), or None.
NativeBlocks = Callable[[list[str]], QuantizedWeight | None]


@dataclass
class QuantizedModel:
    """What `quantize_model` did: weights per source, and the bytes now held in each format."""

    native: int = 0  # weights loaded from the GGUF's own blocks
    quantized: int = 0  # weights quantised from fp32 at load
    cached: bool = False  # read from the narrow-weight cache
    # the packed cache's file the QuantizedLinears' weights are views of (None: their own)
    mapped: MappedFile | None = None
    bytes_by_format: dict[str, int] = field(default_factory=dict)

    def count(self, weight: QuantizedWeight, native: bool) -> None:
        """One more weight in ``weight``'s format, from the file's blocks (``native``) or not."""
        if native:
            self.native += 1
        else:
            self.quantized += 1
        self.bytes_by_format[weight.fmt] = self.bytes_by_format.get(weight.fmt, 0) + weight.nbytes


class _Quantizer:
    """Chooses each weight's QuantizedWeight (or None: stays dense) for one mode, from ``cached``
    choices (by parameter name) where given; `choices` are what it chose, for the cache."""

    def __init__(
        self, mode: str, native: NativeBlocks | None, cached: Mapping[str, Choice] | None
    ) -> None:
        self.mode, self.native, self.cached = mode, native, cached
        self.report = QuantizedModel()
        self.choices: dict[str, Choice] = {}
        self._by_param: dict[int, QuantizedWeight | None] = {}  # tied weights quantise once

    def __call__(
        self, hf_names: list[str], param: nn.Parameter, vocabulary: bool = False
    ) -> QuantizedWeight | None:
        """``vocabulary``: the embedding or lm_head, which int4 mode keeps in int8."""
        key = id(param)
        if key not in self._by_param:
            name = hf_names[0]
            if self.cached is not None and name in self.cached:
                weight, native = self.cached[name]
            else:
                weight, native = self._choose(hf_names, param.detach(), vocabulary)
            if weight is not None:
                self.report.count(weight, native)
            self.choices[name] = (weight, native)
            self._by_param[key] = weight
        return self._by_param[key]

    def _choose(self, hf_names: list[str], dense: torch.Tensor, vocabulary: bool) -> Choice:
        if not quantizable(dense):
            return None, False
        fmt = "int8" if vocabulary and self.mode == "int4" else self.mode
        native = self.native(hf_names) if self.native else None
        # in the format asked for, or in its narrower spelling (Q8_0's int8h for int8)
        if native is not None and (fmt == "gguf" or native.fmt in (fmt, NARROWER.get(fmt))):
            return native, True
        if fmt == "gguf":
            return None, False
        return quantize(native.dequantize() if dense.is_meta else dense, fmt), False


def quantize_model(
    model: nn.Module,
    mode: str,
    native: NativeBlocks | None,
    lib: ctypes.CDLL,
    cache: Path | None = None,
) -> QuantizedModel:
    """Replace ``model``'s linears and input embedding with narrow-weight ones (see the module),
    taking a weight's file blocks from ``native`` where it gives them; returns what was done.
    Linears left dense stay nn.Linear (the caller prepacks them). With ``cache``
    (engine.model.cpu.narrow_cache.cache_path), the choices come from that file when it exists
    and go into it when not, and the packed weights are views of their cache's file
    (engine.model.cpu.packed_cache), written when missing."""
    wait_for_writes()  # an earlier load's cache files, complete before they are read
    cached = narrow_cache.load(cache) if cache else None
    slots = PackedSlots(lib, packed_cache.cache_path(cache, lib) if cache else None)
    if cached is not None and cached.packed is not None and not slots.maps(cached.packed):
        cached = None  # described weights, whose packed file is gone or another kernel build's
    choose = _Quantizer(mode, native, cached)
    try:
        _replace_modules(model, choose, slots, lib)
    except BaseException:
        slots.abandon()  # no half-written packed file left behind
        raise
    mapped = slots.finish()
    if cache and cached is None:
        choices, kept = dict(choose.choices), _records_read(model, choose.choices)
        packed = None if mapped is None else mapped.layout
        write_behind(lambda: narrow_cache.save(cache, choices, packed, kept))
    choose.report.cached = cached is not None
    choose.report.mapped = mapped
    return choose.report


def _records_read(model: nn.Module, choices: Mapping[str, Choice]) -> set[str]:
    """The weights whose records the model reads itself, not from a packed file (an embedding
    table not tied to a narrow head): a cache must hold their records."""
    tables = [
        m.records
        for m in model.modules()
        if isinstance(m, QuantizedEmbedding) and m.records is not None
    ]
    return {
        name
        for name, (weight, _) in choices.items()
        if weight is not None and any(weight.records is t for t in tables)
    }


def _replace_modules(
    model: nn.Module, choose: _Quantizer, slots: PackedSlots, lib: ctypes.CDLL
) -> None:
    """quantize_model's replacing of the linears and the input embedding."""
    names: dict[int, list[str]] = {}  # a tied parameter has several names
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)

    vocabulary = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}

    def weight_of(linear: nn.Linear) -> QuantizedWeight | None:
        key = id(linear.weight)
        return choose(names[key], linear.weight, key in vocabulary)

    def build(linears: list[nn.Linear], paired: bool) -> QuantizedLinear | None:
        parts = [weight_of(m) for m in linears]
        if any(p is None for p in parts):
            return None
        # parts of mixed formats (a Q4_K_M file's Q4_K q/k beside a Q6_K v) fuse in int8k, or a
        # narrower format that holds them (its Q5_0 q/k beside a Q8_0 v in int8h), or in int8km
        # where a part is Q2_K's int2k: the one-call decode step runs fused projections only
        return QuantizedLinear(concatenate(parts), stacked_bias(linears), lib, paired, slots)

    embedding = model.get_input_embeddings()
    tied = id(embedding.weight) == id(model.get_output_embeddings().weight)
    if narrowable_embedding(embedding):
        table = choose(names[id(embedding.weight)], embedding.weight, vocabulary=True)
        if table is not None:
            scale = _embedding_scale(embedding)
            model.set_input_embeddings(QuantizedEmbedding(table, embedding.weight.dtype, scale))
    for parent in list(model.modules()):
        fuse_groups(parent, build)
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (weight := weight_of(child)) is not None:
                paired = own_gate_up(child_name, child)
                narrow = QuantizedLinear(weight, child.bias, lib, paired, slots)
                setattr(parent, child_name, narrow)
    narrow_table, head = model.get_input_embeddings(), model.get_output_embeddings()
    if tied and isinstance(narrow_table, QuantizedEmbedding) and isinstance(head, QuantizedLinear):
        narrow_table.tie_to(head)
    # The parameters left (norms, dense linears) may be views of the loaded file's mapping, which
    # stays mapped, and its pages resident, for as long as one of them lives: copies let it go.
    for param in model.parameters():
        if not param.is_meta:
            param.data = param.data.clone()


def narrowable_embedding(module: nn.Module) -> bool:
    """Whether a QuantizedEmbedding can stand in for ``module``: a plain embedding, or one that
    only scales its rows."""
    return type(module) is nn.Embedding or (
        isinstance(module, nn.Embedding) and hasattr(module, "embed_scale")
    )


def _embedding_scale(embedding: nn.Embedding) -> float | None:
    """The factor a scaled embedding (Gemma's: sqrt(hidden)) multiplies its rows by, in the
    dtype it multiplies in; None for a plain one."""
    scale = getattr(embedding, "embed_scale", None)
    if scale is None:
        return None
    return float(torch.as_tensor(scale).to(embedding.weight.dtype))
