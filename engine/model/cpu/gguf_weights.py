"""A GGUF file's weights put into a transformers model built on the meta device: no fp32 copy of a
tensor the narrow kernels read as the file holds it.

transformers alone dequantises every tensor of a GGUF to fp32 (a Q4_K_M file then takes ~7x its
size in RAM before anything is repacked). Here the model is built with its parameters on the meta
device; each tensor whose block type a narrow format holds exactly (quant_formats.GGUF_BLOCKS)
becomes a QuantizedWeight straight from the file's mapped blocks, and only the others (norms,
biases, block types no format holds) are dequantised, the way transformers does it (its
per-architecture TensorProcessor: Llama's q/k row order, Gemma's (1 + w) norms). A row order a
processor applies to a quantised tensor is found by running it on the row indices, so the
blocks move with the rows, bit for bit.

`load` leaves those tensors on the meta device (with ``keep_blocks``), `native` gives
engine.model.cpu.quantize a parameter's blocks, and `materialize` fills whatever is still on the
meta device with its dequantised tensor (everything, where a weight stays dense).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine import startup
from engine.model.cpu.gguf_file import GgufFile
from engine.model.cpu.quant_formats import GGUF_BLOCKS, QuantizedWeight, from_gguf_blocks
from engine.model.cpu.quantize import narrowable_embedding

if TYPE_CHECKING:  # the model may be a skeleton (engine.model.skeleton): no modeling import
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class GgufWeights:
    """The tensors of the GGUF file at ``path`` for ``model`` (built on the meta device)."""

    def __init__(self, path: Path, model: PreTrainedModel) -> None:
        import gguf  # deferred: only GGUF sources need it
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = path
        self._gguf = gguf
        file = GgufFile(path)
        text = model.config.get_text_config()
        processor = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)(text.to_dict())
        self._processor = processor
        self._hf_names = _hf_names(model, processor, file.architecture, text.num_hidden_layers)
        self._tensors = file.tensors
        self._by_hf = {hf: n for n, hf in self._hf_names.items() if n in self._tensors}

    def load(self, model: PreTrainedModel, keep_blocks: bool) -> None:
        """The tensors into ``model`` dequantised; with ``keep_blocks``, those of linears and
        embeddings whose blocks a narrow format holds stay on the meta device for `native`."""
        blockable = _blockable_parameters(model) if keep_blocks else set()
        dense: dict[str, torch.Tensor] = {}
        for done, (name, tensor) in enumerate(self._tensors.items()):
            startup.progress(done, len(self._tensors))  # the engine's /status shows it
            if self._hf_names.get(name) in blockable and self._row_order(name, tensor) is not None:
                continue
            dense.update(self._dense(name, tensor))
        model.load_state_dict(dense, strict=False, assign=True)
        model.tie_weights()
        # transformers' init leaves flagged tensors alone: flag the parameters the model now holds
        # (assign=True wrapped the loaded tensors in new ones), or the init of a module with a
        # buffer to build (Gemma's scaled embedding) redraws its loaded weight at random
        for param in model.parameters():
            if not param.is_meta:
                param._is_hf_initialized = True
        _init_buffers(model)

    def native(self, hf_names: list[str]) -> QuantizedWeight | None:
        """The file's blocks of the parameter named ``hf_names`` (several when tied) as a
        narrow weight, or None where no format holds them as they are."""
        name = next((self._by_hf[n] for n in hf_names if n in self._by_hf), None)
        return None if name is None else self._blocks(name, self._tensors[name])

    def materialize(self, model: nn.Module) -> int:
        """Every parameter of ``model`` still on the meta device, dequantised from the file;
        returns how many. Then the file's mapping is let go."""
        missing: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            if param.is_meta and name in self._by_hf:
                gguf_name = self._by_hf[name]
                missing.update(self._dense(gguf_name, self._tensors[gguf_name]))
        if missing:
            model.load_state_dict(missing, strict=False, assign=True)
            if isinstance(model.get_input_embeddings(), nn.Embedding):  # not narrow: tie again
                model.tie_weights()
        left = [name for name, param in model.named_parameters() if param.is_meta]
        if left:
            raise ValueError(f"the GGUF file holds no tensor for {', '.join(left[:5])}")
        self._tensors.clear()  # the file's mapping goes with its last view
        return len(missing)

    def _row_order(self, name: str, tensor: object) -> np.ndarray | None:
        """The order transformers puts the rows of a tensor a narrow format holds in (row i of
        the parameter is row order[i] of the file's), or None where no format holds its block
        type or its processor does more than reorder rows."""
        if tensor.tensor_type.name not in GGUF_BLOCKS:
            return None
        rows = int(tensor.shape[1])
        index = np.arange(rows, dtype=np.float32).reshape(rows, 1)
        result = self._processor.process(
            weights=index, name=name, tensor_key_mapping=self._hf_names, parsed_parameters={}
        )
        order = np.asarray(result.weights).reshape(-1)
        if result.name != name or order.shape != (rows,):
            return None
        return order.astype(np.int64) if np.array_equal(np.sort(order), index[:, 0]) else None

    def _blocks(self, name: str, tensor: object) -> QuantizedWeight | None:
        """The tensor's blocks in the row order transformers gives it (see `_row_order`)."""
        order = self._row_order(name, tensor)
        if order is None:
            return None
        weight = from_gguf_blocks(
            tensor.tensor_type.name, np.asarray(tensor.data), int(tensor.shape[0])
        )
        if np.array_equal(order, np.arange(len(order))):
            return weight
        return weight.rows(torch.from_numpy(order))

    def _dense(self, name: str, tensor: object) -> dict[str, torch.Tensor]:
        """The tensor dequantised to fp32 and processed as transformers does, by HF name."""
        values = self._gguf.dequantize(tensor.data, tensor.tensor_type)
        parsed: dict[str, dict] = {"config": {}, "tensors": {}}
        result = self._processor.process(
            weights=values, name=name, tensor_key_mapping=self._hf_names, parsed_parameters=parsed
        )
        out = {n: t.float() for n, t in parsed["tensors"].items()}  # processors that split
        if result.name in self._hf_names:
            array = np.ascontiguousarray(result.weights, dtype=np.float32)
            out[self._hf_names[result.name]] = torch.from_numpy(array.copy())
        return out


def _hf_names(
    model: nn.Module, processor: object, architecture: str, num_layers: int
) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name for ``model``, by gguf's name map of the file's
    architecture (transformers' get_gguf_hf_weights_map builds that map again for every module
    it recurses into: 2 s for Gemma 3). A name the map lacks is tried without its leading
    components (a submodule's view of it), as that recursion does."""
    import gguf

    arches = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    if architecture not in arches:
        raise NotImplementedError(f"gguf does not know the architecture {architecture!r}")
    name_map = gguf.get_tensor_name_map(arches[architecture], num_layers)
    found: dict[str, str] = {}
    for hf_name in model.state_dict():
        name = processor.preprocess_name(hf_name)
        stem, dot, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):
            stem, dot, suffix = name, "", ""
        parts = stem.split(".")
        for first in range(len(parts)):
            gguf_name = name_map.get_name(".".join(parts[first:]))
            if gguf_name is not None:
                found.setdefault(f"{gguf_name}{dot}{suffix}", hf_name)
                break
        else:
            processor.perform_fallback_tensor_mapping(found, dot + suffix, "", hf_name)
    return found


def _blockable_parameters(model: nn.Module) -> set[str]:
    """Names of the weights engine.model.cpu.quantize can put on narrow weights: plain linears'
    and the input embedding's (and so a head tied to it)."""
    embedding = model.get_input_embeddings()
    names = set()
    for module_name, module in model.named_modules():
        if type(module) is nn.Linear or (module is embedding and narrowable_embedding(module)):
            names.add(f"{module_name}.weight")
    return names


def _init_buffers(model: PreTrainedModel) -> None:
    """The non-persistent buffers (rotary tables, embedding scales) built on the meta device,
    computed again on the CPU by the model's own init (which skips the loaded parameters)."""
    owners: list[nn.Module] = []
    for module in model.modules():
        meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        for buffer_name in meta:
            module._buffers[buffer_name] = torch.empty_like(
                module._buffers[buffer_name], device="cpu"
            )
        if meta:
            owners.append(module)
    for module in owners:
        model._init_weights(module)
