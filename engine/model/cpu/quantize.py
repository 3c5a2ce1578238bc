"""Putting a loaded model's linears and embedding on narrow weights (``--quantization``).

Where each weight comes from: a GGUF tensor whose blocks a format holds exactly (Q8_0 -> int8,
Q4_1 / Q4_0 -> int4) loads as it is, checked against the weight transformers dequantised from the
same blocks (and turned by the same row permutation: transformers un-permutes Llama's q/k rows);
any other weight of a quantizable shape is quantised from its fp32 values. ``gguf`` mode (the
default for GGUF files) takes only the first kind and leaves the rest dense; ``int8`` / ``int4``
put every linear in that format, except that int4 keeps the embedding and lm_head in int8 (as
llama.cpp's quantiser keeps its output tensor at 6 bits or more: in int4 SmolLM2's top token
changed on half of the load probe). q/k/v and gate/up fuse into one GEMM each, as on the dense path;
an lm_head tied to the embedding shares its records.

engine.model.cpu.narrow_weights checks the result against the dense forward on a probe, as the
lean forward is checked: a format that moves the model's predictions too far is refused.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.model.cpu import narrow_cache
from engine.model.cpu.linear import fuse_groups, stacked_bias
from engine.model.cpu.narrow_cache import Choice
from engine.model.cpu.quant_formats import (
    GGUF_BLOCKS,
    QuantizedWeight,
    concatenate,
    from_gguf_blocks,
    quantizable,
    quantize,
)
from engine.model.cpu.quant_linear import QuantizedEmbedding, QuantizedLinear

MODES = ("gguf", "int8", "int4")


@dataclass
class QuantizedModel:
    """What `quantize_model` did: weights per source, and the bytes now held in each format."""

    native: int = 0  # weights loaded from the GGUF's own blocks
    quantized: int = 0  # weights quantised from fp32 at load
    cached: bool = False  # read from the narrow-weight cache
    bytes_by_format: dict[str, int] = field(default_factory=dict)

    def count(self, weight: QuantizedWeight, native: bool) -> None:
        """One more weight in ``weight``'s format, from the file's blocks (``native``) or not."""
        if native:
            self.native += 1
        else:
            self.quantized += 1
        self.bytes_by_format[weight.fmt] = self.bytes_by_format.get(weight.fmt, 0) + weight.nbytes


class GgufBlocks:
    """The quantised tensors of a GGUF file, by the HF parameter names transformers gave them."""

    def __init__(self, path: Path, num_layers: int) -> None:
        import gguf  # deferred: only GGUF sources need it

        self._reader = gguf.GGUFReader(path)
        arch_name = bytes(self._reader.fields["general.architecture"].parts[-1]).decode()
        arches = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
        self._names = (
            gguf.get_tensor_name_map(arches[arch_name], num_layers) if arch_name in arches else None
        )
        self._tensors = {t.name: t for t in self._reader.tensors}

    def weight(
        self, hf_names: list[str], dense: torch.Tensor, heads: tuple[int, int]
    ) -> QuantizedWeight | None:
        """The GGUF blocks of the parameter named ``hf_names`` (several when tied) whose values
        are ``dense`` [N, K] (as transformers loaded them), or None where the file holds it in
        another type or the blocks do not reproduce ``dense`` under any row order transformers
        applies."""
        if self._names is None:
            return None
        found = (self._names.get_name(name, try_suffixes=(".weight",)) for name in hf_names)
        tensor = next((self._tensors[n] for n in found if n in self._tensors), None)
        if tensor is None or tensor.tensor_type.name not in GGUF_BLOCKS:
            return None
        raw = np.asarray(tensor.data)
        if raw.shape[0] != dense.shape[0]:
            return None
        weight = from_gguf_blocks(tensor.tensor_type.name, raw, dense.shape[1])
        for order in _row_orders(dense.shape[0], heads):
            candidate = weight if order is None else weight.rows(order)
            if torch.equal(candidate.dequantize(), dense.float()):
                return candidate
        return None


def _row_orders(rows: int, heads: tuple[int, int]) -> list[torch.Tensor | None]:
    """Row orders transformers may have applied to a GGUF tensor: none, or Llama's q/k
    un-permutation for either head count."""
    orders: list[torch.Tensor | None] = [None]
    for count in dict.fromkeys(heads):
        if count and rows % (2 * count) == 0:
            index = torch.arange(rows).reshape(count, rows // count // 2, 2)
            orders.append(index.transpose(1, 2).reshape(rows))
    return orders


class _Quantizer:
    """Chooses each weight's QuantizedWeight (or None: stays dense) for one mode, from ``cached``
    choices (by parameter name) where given; `choices` are what it chose, for the cache."""

    def __init__(
        self,
        mode: str,
        blocks: Callable[[], GgufBlocks | None],
        heads: tuple[int, int],
        cached: dict[str, Choice] | None,
    ) -> None:
        self.mode, self.heads, self.cached = mode, heads, cached
        self._open_blocks = blocks
        self._blocks: GgufBlocks | None = None
        self.report = QuantizedModel()
        self.choices: dict[str, Choice] = {}
        self._by_tensor: dict[int, QuantizedWeight | None] = {}  # tied weights quantise once

    def __call__(
        self, hf_names: list[str], dense: torch.Tensor, vocabulary: bool = False
    ) -> QuantizedWeight | None:
        """``vocabulary``: the embedding or lm_head, which int4 mode keeps in int8."""
        key = dense.data_ptr()
        if key not in self._by_tensor:
            name = hf_names[0]
            if self.cached is not None and name in self.cached:
                weight, native = self.cached[name]
            else:
                weight, native = self._choose(hf_names, dense, vocabulary)
            if weight is not None:
                self.report.count(weight, native)
            self.choices[name] = (weight, native)
            self._by_tensor[key] = weight
        return self._by_tensor[key]

    def _choose(self, hf_names: list[str], dense: torch.Tensor, vocabulary: bool) -> Choice:
        if not quantizable(dense):
            return None, False
        fmt = "int8" if vocabulary and self.mode == "int4" else self.mode
        if self._blocks is None:
            self._blocks = self._open_blocks()
        native = self._blocks.weight(hf_names, dense, self.heads) if self._blocks else None
        if native is not None and fmt in ("gguf", native.fmt):
            return native, True
        if fmt == "gguf":
            return None, False
        return quantize(dense, fmt), False


def quantize_model(
    model: nn.Module,
    mode: str,
    gguf_path: Path | None,
    lib: ctypes.CDLL,
    cache: Path | None = None,
) -> QuantizedModel:
    """Replace ``model``'s linears and input embedding with narrow-weight ones (see the module);
    returns what was done. Linears left dense stay nn.Linear (the caller prepacks them). With
    ``cache`` (engine.model.cpu.narrow_cache.cache_path), the choices come from that file when it
    exists and go into it when not."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = (text.num_attention_heads, getattr(text, "num_key_value_heads", 0) or 0)

    def blocks() -> GgufBlocks | None:
        return GgufBlocks(gguf_path, text.num_hidden_layers) if gguf_path else None

    cached = narrow_cache.load(cache) if cache else None
    choose = _Quantizer(mode, blocks, heads, cached)
    names: dict[int, list[str]] = {}  # a tied parameter has several names
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)

    vocabulary = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}

    def weight_of(linear: nn.Linear) -> QuantizedWeight | None:
        key = id(linear.weight)
        return choose(names[key], linear.weight.detach(), key in vocabulary)

    def build(linears: list[nn.Linear], paired: bool) -> QuantizedLinear | None:
        parts = [weight_of(m) for m in linears]
        if any(p is None for p in parts) or len({p.fmt for p in parts}) != 1:
            return None
        return QuantizedLinear(concatenate(parts), stacked_bias(linears), lib, paired)

    embedding = model.get_input_embeddings()
    if type(embedding) is nn.Embedding:
        table = choose(names[id(embedding.weight)], embedding.weight.detach(), vocabulary=True)
        if table is not None:
            model.set_input_embeddings(QuantizedEmbedding(table, embedding.weight.dtype))
    for parent in list(model.modules()):
        fuse_groups(parent, build)
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (weight := weight_of(child)) is not None:
                setattr(parent, child_name, QuantizedLinear(weight, child.bias, lib))
    # The parameters left (norms, dense linears) may be views of the loaded file's mapping, which
    # stays mapped, and its pages resident, for as long as one of them lives: copies let it go.
    for param in model.parameters():
        param.data = param.data.clone()
    if cache and cached is None:
        narrow_cache.save(cache, choose.choices)
    choose.report.cached = cached is not None
    return choose.report
