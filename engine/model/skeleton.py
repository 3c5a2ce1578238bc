"""A GGUF model's module tree, rebuilt without transformers' modeling code.

transformers' modeling modules import torch._dynamo: ~190 MiB of an engine's RSS and ~1.5 s of
its start, for code the CPU fast path never runs (docs/PERFORMANCE.md#model-loading). The lean
forward reads only the module tree: its weights and shapes, and a few attributes (head_dim,
scaling, sliding_window, eps, the rotary inverse frequencies). So a file's first start builds
transformers' model as ever; once the lean forward has matched transformers' logits on it
(engine.model.runner), `describe` records the tree: per module its kind, its plain attributes and
buffers, its parameters' shapes. Later starts with the same file, engine code and options
(`snapshot_key`) `restore` it from plain torch modules, load the file's weights into it and skip
the comparison, whose verdict the record carries. The modules whose forward the lean forward calls
are torch's own (linears, embeddings, activations) or this module's (`ScaledEmbedding`, `Rotary`,
each the same computation as transformers'); every other module is a `Part`, which has none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model.cache_dir import remove_stale, write_atomic_text

log = logging.getLogger(__name__)

# Bump when what a snapshot records, or how it is rebuilt, changes.
SNAPSHOT_VERSION = 1
_ENGINE_ROOT = Path(__file__).resolve().parents[1]
_SILU = frozenset({"SiLU", "SiLUActivation"})
_GELU_TANH = frozenset({"GELUTanh", "PytorchGELUTanh"})
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64)}
_CONFIG = {"config": "text"}  # an attribute that held the model's (text) config


class NotDescribable(ValueError):
    """A module tree `describe` cannot record; the message says which module and why."""


@dataclass
class Node:
    """One module of the tree: its dotted name, kind, class name (for messages), plain
    attributes, parameters' shapes and buffers' values."""

    name: str
    kind: str  # linear, embedding, scaled_embedding, dropout, silu, gelu_tanh, rotary, list, part
    type_name: str
    attrs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, list[int]] = field(default_factory=dict)
    buffers: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Snapshot:
    nodes: list[Node]
    input_embeddings: str
    output_embeddings: str
    tied: bool
    eos_token_ids: list[int]
    version: int = SNAPSHOT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Snapshot:
        raw = json.loads(text)
        if raw.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {raw.get('version')}, not {SNAPSHOT_VERSION}")
        raw["nodes"] = [Node(**node) for node in raw["nodes"]]
        return cls(**raw)


# ------------------------------------------------------------------------------- recording
def describe(model: nn.Module, eos_token_ids: set[int]) -> Snapshot:
    """The record of ``model``'s tree (transformers' model, its weights still unreplaced).
    Raises `NotDescribable` where a module is one `restore` could not rebuild the same."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    if id(embedding) not in names or id(head) not in names:
        raise NotDescribable("its embeddings are not modules of its tree")
    return Snapshot(
        nodes=[_node(name, module) for name, module in model.named_modules()],
        input_embeddings=names[id(embedding)],
        output_embeddings=names[id(head)],
        tied=head.weight is embedding.weight,
        eos_token_ids=sorted(eos_token_ids),
    )


def _node(name: str, module: nn.Module) -> Node:
    kind = _kind(name, module)
    node = Node(name, kind, type(module).__name__)
    node.params = {n: list(p.shape) for n, p in module.named_parameters(recurse=False)}
    if any(p.dtype != torch.float32 for p in module.parameters(recurse=False)):
        raise NotDescribable(f"{name}: parameters other than float32")
    if kind in ("linear", "embedding", "scaled_embedding", "dropout", "silu", "gelu_tanh"):
        node.attrs = _leaf_attrs(kind, module)
    elif kind in ("rotary", "part"):
        node.attrs = {k: v for k, v in vars(module).items() if _plain_attr(k, v)}
        node.attrs.update({k: _CONFIG for k, v in vars(module).items() if _is_config(v)})
    for buffer_name, buffer in module.named_buffers(recurse=False):
        if buffer.dtype not in _DTYPES.values():
            raise NotDescribable(f"{name}: buffer {buffer_name} of dtype {buffer.dtype}")
        node.buffers[buffer_name] = {
            "dtype": str(buffer.dtype),
            "shape": list(buffer.shape),
            "values": buffer.reshape(-1).tolist(),
            "persistent": buffer_name not in module._non_persistent_buffers_set,
        }
    if node.buffers and kind not in ("rotary", "scaled_embedding"):
        raise NotDescribable(f"{name} ({node.type_name}): buffers its rebuild would not use")
    return node


def _kind(name: str, module: nn.Module) -> str:
    kind = type(module)
    if kind is nn.Linear:
        return "linear"
    if kind is nn.Embedding:
        return "embedding"
    if isinstance(module, nn.Embedding) and set(module._buffers) == {"embed_scale"}:
        return "scaled_embedding"
    if kind is nn.Dropout:
        return "dropout"
    if kind is nn.ModuleList:
        return "list"
    activation = activation_kind(module)
    if activation is not None:
        return activation
    if kind.__name__.endswith("RotaryEmbedding"):
        rope_types = getattr(module, "rope_type", "default")
        types = rope_types.values() if isinstance(rope_types, dict) else [rope_types]
        if any("dynamic" in str(t) or t == "longrope" for t in types):
            raise NotDescribable(f"{name}: rotary type {rope_types} rescales with the length")
        return "rotary"
    # a container (layer, attention, MLP) or a norm: the lean forward calls no such module's
    # forward (an embedding or activation of another class it refuses, whatever the tree)
    return "part"


def activation_kind(module: object) -> str | None:
    """``silu`` or ``gelu_tanh`` for the activation modules the lean forward runs (torch's and
    transformers' classes of each), else None."""
    name = type(module).__name__
    if name in _SILU:
        return "silu"
    if name in _GELU_TANH or (isinstance(module, nn.GELU) and module.approximate == "tanh"):
        return "gelu_tanh"
    return None


def _leaf_attrs(kind: str, module: nn.Module) -> dict[str, Any]:
    if kind == "linear":
        return {
            "in_features": module.in_features,
            "out_features": module.out_features,
            "bias": module.bias is not None,
        }
    if kind in ("embedding", "scaled_embedding"):
        return {
            "num_embeddings": module.num_embeddings,
            "embedding_dim": module.embedding_dim,
            "padding_idx": module.padding_idx,
        }
    if kind == "dropout":
        return {"p": module.p}
    return {}


def _plain_attr(key: str, value: object) -> bool:
    """An attribute `restore` sets again: public, and JSON's (numbers, strings, lists, dicts)."""
    if key.startswith("_") or key == "training":
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain_attr("item", v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_attr("item", v) for k, v in value.items())
    return False


def _is_config(value: object) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


# ------------------------------------------------------------------------------- rebuilding
class Part(nn.Module):
    """A module of the tree whose forward the lean forward never calls (a layer, an attention or
    MLP block, a norm): its children, parameters and attributes only."""

    def __init__(self, type_name: str) -> None:
        super().__init__()
        self.type_name = type_name

    def extra_repr(self) -> str:
        return self.type_name


class ScaledEmbedding(nn.Embedding):
    """An embedding whose rows are scaled by ``embed_scale`` (Gemma's: sqrt(hidden)), as
    transformers' Gemma3TextScaledWordEmbedding computes it."""

    embed_scale: torch.Tensor

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class Rotary(nn.Module):
    """transformers' rotary module for position-only rotary types (default, linear, llama3,
    yarn, ...: the inverse frequencies and scaling its init computed): one table, or one per
    layer type (``{type}_inv_freq``, ``{type}_attention_scaling``: Gemma 3)."""

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = f"{layer_type}_" if layer_type else ""
        inv_freq = getattr(self, f"{prefix}inv_freq")
        scaling = getattr(self, f"{prefix}attention_scaling")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)


class SkeletonCausalLM(Part):
    """The rebuilt tree's root: what the loader, the narrow weights and the lean forward ask of a
    transformers causal LM besides its modules (its config, embeddings and their tie)."""

    def __init__(self, snapshot: Snapshot, config: Any) -> None:
        super().__init__(snapshot.nodes[0].type_name)
        self.config = config
        self._input_name = snapshot.input_embeddings
        self._output_name = snapshot.output_embeddings
        self._tied = snapshot.tied

    def get_input_embeddings(self) -> nn.Module:
        return self.get_submodule(self._input_name)

    def set_input_embeddings(self, module: nn.Module) -> None:
        parent, _, child = self._input_name.rpartition(".")
        setattr(self.get_submodule(parent), child, module)

    def get_output_embeddings(self) -> nn.Module:
        return self.get_submodule(self._output_name)

    def tie_weights(self) -> None:
        if self._tied:
            self.get_output_embeddings().weight = self.get_input_embeddings().weight


def restore(snapshot: Snapshot, config: Any) -> SkeletonCausalLM:
    """The tree ``snapshot`` recorded, parameters on the meta device (for GgufWeights to load),
    buffers as recorded; ``config``: the model's config, whose text config stands for every
    attribute that held one."""
    text = config.get_text_config()
    root = SkeletonCausalLM(snapshot, config)
    for node in snapshot.nodes:
        module = root if not node.name else _module(node, text)
        for name, shape in node.params.items():
            module.register_parameter(name, nn.Parameter(torch.empty(shape, device="meta")))
        for name, buffer in node.buffers.items():
            values = torch.tensor(buffer["values"], dtype=_DTYPES[buffer["dtype"]])
            module.register_buffer(
                name, values.reshape(buffer["shape"]), persistent=buffer["persistent"]
            )
        if node.name:
            parent, _, child = node.name.rpartition(".")
            root.get_submodule(parent).add_module(child, module)
    root.tie_weights()
    return root


def _module(node: Node, text_config: Any) -> nn.Module:
    attrs = node.attrs
    if node.kind == "linear":
        # parameters on the meta device, replaced by the node's; device= rather than a
        # torch.device("meta") context, which routes the init through torch._refs (and so
        # imports torch._dynamo)
        return nn.Linear(attrs["in_features"], attrs["out_features"], attrs["bias"], device="meta")
    if node.kind in ("embedding", "scaled_embedding"):
        kind = ScaledEmbedding if node.kind == "scaled_embedding" else nn.Embedding
        shape = (attrs["num_embeddings"], attrs["embedding_dim"])
        # given a weight: no init (a meta tensor's normal_ imports torch._dynamo too)
        return kind(*shape, attrs["padding_idx"], _weight=torch.empty(shape, device="meta"))
    if node.kind == "dropout":
        return nn.Dropout(attrs["p"])
    if node.kind == "silu":
        return nn.SiLU()
    if node.kind == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if node.kind == "list":
        return nn.ModuleList()
    module = Rotary() if node.kind == "rotary" else Part(node.type_name)
    for key, value in attrs.items():
        setattr(module, key, text_config if value == _CONFIG else value)
    return module


# ------------------------------------------------------------------------------- the cache
def snapshot_key(file_sha: str, options: dict[str, str]) -> str:
    """What a snapshot's verdict depends on: the file, the engine's code (every source file of
    the engine package), transformers' and torch's versions, and the engine's numeric
    options."""
    import transformers

    digest = hashlib.sha256()
    for part in (file_sha, transformers.__version__, torch.__version__, str(SNAPSHOT_VERSION)):
        digest.update(part.encode() + b"\0")
    digest.update(json.dumps(options, sort_keys=True).encode() + b"\0")
    for path in sorted(_ENGINE_ROOT.rglob("*")):
        if path.suffix in (".py", ".c", ".h"):
            digest.update(str(path.relative_to(_ENGINE_ROOT)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def read(path: Path) -> Snapshot | None:
    """The snapshot at ``path``, or None where there is none (or it cannot be read)."""
    try:
        snapshot = Snapshot.from_json(path.read_text())
        os.utime(path)  # in use: not stale
        return snapshot
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the unreadable model snapshot %s: %s", path, exc)
        return None


@dataclass
class SnapshotSlot:
    """A load's snapshot: where it lives, the one found there (the model is rebuilt from it, and
    the lean forward's verdict is in hand), and the record a first start writes once the lean
    forward passed its check (`save`)."""

    path: Path
    found: Snapshot | None = None
    pending: Snapshot | None = None

    @property
    def restored(self) -> bool:
        return self.found is not None

    def save(self) -> None:
        if self.pending is None:
            return
        write_atomic_text(self.path, self.pending.to_json())
        remove_stale(self.path.parent, "*.json")
        self.pending = None

    def discard(self) -> None:
        """Remove a snapshot that did not rebuild a model the lean forward runs: the next start
        checks against transformers again."""
        self.path.unlink(missing_ok=True)
