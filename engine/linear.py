"""Linear layers on the device's fastest path: oneDNN-prepacked weights on CPU.

On CPU, ``F.linear`` re-lays the weight out for oneDNN on every call; reordering it once at load
(what inductor's weight freezing does) makes the model's GEMMs markedly faster from a few rows on.
For a single row (batch-1 decode) a GEMV on a plain copy of the weight is faster still (SmolLM2's
linears: 39 ms instead of 61 ms per step), so the plain copy is kept too, at the price of holding
the linear weights twice (+540 MB for SmolLM2 in fp32). bf16 weights (on CPUs with AVX512-BF16 or
AMX) run every GEMM prepacked, single rows included: SmolLM2's linears at 64 rows took 24 ms in bf16
against 67 ms in fp32 here. On CUDA the plain ``nn.Linear`` already
runs cuBLAS, so nothing is replaced there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_threads import all_threads, release


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacking applies to weights of this device and dtype (bf16 needs a CPU
    with native bf16 instructions: AVX512-BF16 or AMX)."""
    if dtype == torch.bfloat16:
        dtype_ok = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    else:
        dtype_ok = dtype == torch.float32
    return (
        device.type == "cpu"
        and dtype_ok
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PrepackedLinear(nn.Module):
    """``y = x W^T + b`` with W held in oneDNN's blocked layout (fp32: and plain, for single rows;
    bf16 single rows run faster prepacked, so no plain copy is kept)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, batch_size_hint: int
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        # A fresh copy: the loaded weight may live in file-backed memory, from which the batch-1
        # GEMVs streamed ~22% slower.
        plain = weight.detach().clone() if weight.dtype == torch.float32 else None
        self.register_buffer("plain_weight", plain, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().clone(), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        # Inside cpu_threads.split_threads, every GEMM gets all threads: per-GEMM thresholds that
        # won in isolated micro-benchmarks (one thread below ~8M multiply-adds) lost ~10% of the
        # model's GEMM time at batch 1, where weights stream from memory.
        threads = all_threads()
        if threads:
            torch.set_num_threads(threads)
        if rows.shape[0] == 1 and self.plain_weight is not None:
            y = F.linear(rows, self.plain_weight, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(
                rows, self.packed_weight, self.bias, "none", [], ""
            )
        release(threads)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked=oneDNN"


# Projections that transformers models apply to the same input one after the other; on the
# prepacked path each group runs as one GEMM (fewer, wider GEMMs are faster on CPU).
FUSABLE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjection(nn.Module):
    """One prepacked GEMM for several projections of the same input.

    The model still calls each projection by name; the first call computes every output, the
    others take their slice if they get the very same, unmodified input tensor (identity and
    version counter match), and recompute otherwise.
    """

    def __init__(self, linears: list[nn.Linear], batch_size_hint: int) -> None:
        super().__init__()
        weight = torch.cat([m.weight.detach() for m in linears])
        has_bias = linears[0].bias is not None
        bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None
        self.gemm = PrepackedLinear(weight, bias, batch_size_hint)
        self.widths = [m.out_features for m in linears]
        self._pending = _Pending()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        state = self._pending
        version = _version(x)
        if not (x is state.input and version == state.version and index in state.unserved):
            state.outputs = self.gemm(x).split(self.widths, dim=-1)
            state.input, state.version = x, version
            state.unserved = set(range(len(self.widths)))
        state.unserved.discard(index)
        out = state.outputs[index]
        if not state.unserved:  # every projection served: drop the references
            state.input, state.outputs = None, ()
        return out


class _Pending:
    """Outputs of the last fused GEMM not yet taken (a plain object: nn.Module attribute writes
    cost microseconds, paid per projection per layer per step)."""

    __slots__ = ("input", "outputs", "unserved", "version")

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.version: int | None = -1
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.unserved: set[int] = set()


def _version(x: torch.Tensor) -> int | None:
    """In-place modification counter; inference-mode tensors have none (identity must do)."""
    return None if x.is_inference() else x._version


class FusedMember(nn.Module):
    """Stands in for one projection of a FusedProjection."""

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        self.in_features = fused.gemm.in_features
        self.out_features = fused.widths[index]
        self.index = index
        object.__setattr__(self, "fused", fused)  # not a submodule: the parent owns it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.output(self.index, x)


def _fuse_groups(parent: nn.Module, batch_size_hint: int) -> int:
    fused_count = 0
    for names in FUSABLE_GROUPS:
        members = [getattr(parent, name, None) for name in names]
        if not all(type(m) is nn.Linear for m in members):
            continue
        if (
            len({m.in_features for m in members}) != 1
            or len({m.bias is None for m in members}) != 1
        ):
            continue
        fused = FusedProjection(members, batch_size_hint)
        parent.add_module("fused_" + "_".join(n.split("_")[0] for n in names), fused)
        for index, name in enumerate(names):
            setattr(parent, name, FusedMember(fused, index))
        fused_count += 1
    return fused_count


def prepack_linears(model: nn.Module, batch_size_hint: int, fuse: bool = True) -> int:
    """Replace every ``nn.Linear`` in ``model`` with prepacked GEMMs; return how many GEMMs.

    With ``fuse``, q/k/v and gate/up projections of one module become one GEMM each.

    Tied weights (an lm_head sharing the embedding matrix) are safe: the embedding keeps the
    original tensor and the lm_head gets its own packed copy.
    """
    replaced = 0
    for parent in list(model.modules()):
        if fuse:
            replaced += _fuse_groups(parent, batch_size_hint)
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = PrepackedLinear(child.weight, child.bias, batch_size_hint)
                setattr(parent, name, packed)
                replaced += 1
    return replaced
