"""Linear layers on the device's fastest path: prepacked weights on CPU.

On CPU, ``F.linear`` re-lays the weight out for oneDNN on every call; reordering it once at load
(what inductor's weight freezing does) makes the model's GEMMs markedly faster from a few rows on.
For decode-sized batches (up to kernels.panel_gemm.MAX_ROWS rows) fp32 weights also get
a copy in the panel layout of the engine's own GEMM, faster still, called through `StepGemms` by
the lean forward (figures: docs/PERFORMANCE.md#panel-gemm). Without the C kernels (no compiler,
or a build with neither AVX-512 nor AVX2) a plain copy serves single rows instead. Either copy
holds the linear weights a second time (+540 MB for SmolLM2 in fp32). bf16 weights (on CPUs with
AVX512-BF16 or AMX; elsewhere the loader loads fp32) run every GEMM prepacked, single rows
included, markedly faster than fp32 (docs/PERFORMANCE.md#bf16). On CUDA the plain ``nn.Linear``
already runs cuBLAS, so nothing is replaced there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.cpu.huge_pages import HugePageArena
from engine.model.cpu.kernels import panel_gemm
from engine.model.cpu.kernels.panel_gemm import PanelOperands
from engine.model.cpu.threads import all_threads, release


def native_bf16() -> bool:
    """Whether this CPU runs oneDNN's bf16 GEMMs natively (AVX512-BF16 or AMX, as oneDNN sees it:
    ONEDNN_MAX_CPU_ISA=AVX2 hides them)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacking applies to weights of this device and dtype (bf16 needs a CPU
    with native bf16 instructions: `native_bf16`)."""
    dtype_ok = native_bf16() if dtype == torch.bfloat16 else dtype == torch.float32
    return (
        device.type == "cpu"
        and dtype_ok
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PrepackedLinear(nn.Module):
    """``y = x W^T + b`` with W held in oneDNN's blocked layout; fp32 also in the panel GEMM's
    layout for decode-sized batches (or, without the C kernels, plain for single rows). bf16 single
    rows run faster prepacked, so no second copy is kept. ``paired``: the weight is an MLP's
    [gate; up], packed so that `StepGemms.silu_mul` can apply the activation inside the GEMM."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_size_hint: int,
        paired: bool = False,
        arena: HugePageArena | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        panels = panel_gemm.pack(weight, paired, arena)
        self.register_buffer("panel_weight", panels, persistent=False)
        self.paired = paired
        # A fresh copy: the loaded weight may live in file-backed memory, from which the batch-1
        # GEMVs streamed slower (docs/PERFORMANCE.md#panel-gemm).
        plain = None
        if weight.dtype == torch.float32 and panels is None:
            plain = weight.detach().clone()
        self.register_buffer("plain_weight", plain, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().clone(), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        # Inside threads.split_threads, every GEMM gets all threads: per-GEMM thresholds that
        # won in isolated micro-benchmarks (one thread below ~8M multiply-adds) lost GEMM time in
        # the model at batch 1, where weights stream from memory
        # (docs/PERFORMANCE.md#thread-wake-ups).
        threads = all_threads()
        if self.panel_weight is not None and rows.shape[0] <= panel_gemm.MAX_ROWS:
            y = self.on_panels(rows.contiguous(), threads or torch.get_num_threads())
            return y.view(*lead, self.out_features)
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

    def on_panels(
        self, rows: torch.Tensor, threads: int, out: torch.Tensor | None = None, gated: bool = False
    ) -> torch.Tensor:
        """``rows`` [M <= panel_gemm.MAX_ROWS, in_features] (fp32, contiguous) through the panel
        GEMM on ``threads`` threads (panel_weight set), into ``out`` when given; with ``gated``
        (paired only) ``silu(gate) * up`` instead of both halves (panel_gemm.linear)."""
        return panel_gemm.linear(
            rows, self.panel_weight, self.out_features, self.bias, threads, out,
            paired=self.paired, gated=gated,
        )  # fmt: skip

    def extra_repr(self) -> str:
        panels = ", panels (decode-sized batches)" if self.panel_weight is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"prepacked=oneDNN{panels}"
        )


class StepGemms:
    """One forward pass's linears (``gemms(linear, x)`` for ``linear(x)``, ``gemms.silu_mul`` for
    an MLP's activated [gate; up]) with one output buffer per output width and kind, reused by
    every layer, each panel GEMM a single ctypes call. Between two GEMMs of a decode step the
    module call's Python and torch work (reshape, allocation, thread bookkeeping) costs many times
    the bare call, as the weight stream evicts the interpreter's code and data (figures:
    docs/PERFORMANCE.md#per-op-overhead). A returned tensor is overwritten by the next call of
    the same width and kind, so the caller consumes each one first (the lean forward does). Rows
    over panel_gemm.MAX_ROWS, inputs not [rows, in_features] contiguous fp32 and linears without
    panels take the module call; so do narrow-weight linears (a decode step's run in one call:
    engine.model.cpu.kernels.narrow_decode)."""

    def __init__(self, rows: int, threads: int | None = None) -> None:
        """``threads``: the GEMMs' team; by default the current split's (threads.split_threads),
        else torch's count, as PrepackedLinear uses."""
        self._rows = rows
        self.threads = threads or all_threads() or torch.get_num_threads()
        self._outputs: dict[tuple[int, bool], torch.Tensor] = {}

    def __call__(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self._on_panels(linear, x):
            return linear(x)
        return self._panel_gemm(linear, x, gated=False)

    def silu_mul(
        self,
        gate_up: nn.Module,
        x: torch.Tensor,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``silu(gate) * up`` of a [gate; up] linear: applied inside the GEMM where it runs on
        paired panels, else ``activation`` of the linear's output [rows, 2W] (the same math)."""
        if getattr(gate_up, "paired", False) and self._on_panels(gate_up, x):
            return self._panel_gemm(gate_up, x, gated=True)
        return activation(self(gate_up, x))

    def fused_operands(self, linear: nn.Module, x: torch.Tensor) -> PanelOperands | None:
        """What a kernel needs to run ``linear(x)`` itself (inside its own parallel region;
        output into this pass's buffer of that width): the panel GEMM's operands; None where the
        panels do not serve it (see the class) or the weight is paired."""
        if getattr(linear, "paired", True) or not self._on_panels(linear, x):
            return None
        width = linear.out_features
        out = self._output(width, gated=False)
        return x, linear.panel_weight, width, linear.bias, out, self.threads

    def _on_panels(self, linear: nn.Module, x: torch.Tensor) -> bool:
        return (
            getattr(linear, "panel_weight", None) is not None
            and self._rows <= panel_gemm.MAX_ROWS
            and x.shape == (self._rows, linear.in_features)
            and x.dtype == torch.float32
            and x.is_contiguous()
        )

    def _panel_gemm(self, linear: PrepackedLinear, x: torch.Tensor, gated: bool) -> torch.Tensor:
        width = linear.out_features // 2 if gated else linear.out_features
        return linear.on_panels(x, self.threads, self._output(width, gated), gated)

    def _output(self, width: int, gated: bool) -> torch.Tensor:
        out = self._outputs.get((width, gated))
        if out is None:
            out = self._outputs[width, gated] = torch.empty(
                (self._rows, width), dtype=torch.float32
            )
        return out


# Projections that transformers models apply to the same input one after the other; on the
# prepacked path each group runs as one GEMM (fewer, wider GEMMs are faster on CPU).
# A model's own [gate; up] linear (Phi-3's), packed paired too (see own_gate_up).
OWN_GATE_UP = "gate_up_proj"
# The MLP's pair, whose fused weight is packed paired (see PrepackedLinear).
GATE_UP = ("gate_proj", "up_proj")
FUSABLE_GROUPS = (("q_proj", "k_proj", "v_proj"), GATE_UP)


class FusedProjection(nn.Module):
    """One prepacked GEMM for several projections of the same input.

    The model still calls each projection by name; the first call computes every output, the
    others take their slice if they get the very same, unmodified input tensor (identity and
    version counter match), and recompute otherwise.
    """

    def __init__(self, gemm: nn.Module, widths: list[int]) -> None:
        """``gemm``: one linear over the projections' stacked weights, ``widths`` their outputs."""
        super().__init__()
        self.widths = widths
        self.gemm = gemm
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


# Builds one GEMM for a group of projections (``paired``: an MLP's [gate; up] of equal widths),
# or None where it cannot.
GemmBuilder = Callable[[list[nn.Linear], bool], "nn.Module | None"]


def fuse_groups(parent: nn.Module, build: GemmBuilder) -> int:
    """Replace each of ``parent``'s FUSABLE_GROUPS (plain nn.Linears of one input width and bias
    kind) with a FusedProjection on ``build``'s GEMM; return how many were fused."""
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
        paired = names == GATE_UP and members[0].out_features == members[1].out_features
        gemm = build(members, paired)
        if gemm is None:
            continue
        fused = FusedProjection(gemm, [m.out_features for m in members])
        parent.add_module("fused_" + "_".join(n.split("_")[0] for n in names), fused)
        for index, name in enumerate(names):
            setattr(parent, name, FusedMember(fused, index))
        fused_count += 1
    return fused_count


def stacked_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The concatenated biases of ``linears`` (all with or all without one)."""
    if linears[0].bias is None:
        return None
    return torch.cat([m.bias.detach() for m in linears])


def prepack_linears(model: nn.Module, batch_size_hint: int, fuse: bool = True) -> int:
    """Replace every ``nn.Linear`` in ``model`` with prepacked GEMMs; return how many GEMMs.

    With ``fuse``, q/k/v and gate/up projections of one module become one GEMM each.

    Tied weights (an lm_head sharing the embedding matrix) are safe: the embedding keeps the
    original tensor and the lm_head gets its own packed copy. The panel copies share huge-page
    memory (engine.model.cpu.huge_pages).
    """
    replaced = 0
    arena = HugePageArena()

    def build(linears: list[nn.Linear], paired: bool) -> PrepackedLinear:
        weight = torch.cat([m.weight.detach() for m in linears])
        return PrepackedLinear(weight, stacked_bias(linears), batch_size_hint, paired, arena)

    for parent in list(model.modules()):
        if fuse:
            replaced += fuse_groups(parent, build)
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                paired = own_gate_up(name, child)
                packed = PrepackedLinear(
                    child.weight, child.bias, batch_size_hint, paired, arena=arena
                )
                setattr(parent, name, packed)
                replaced += 1
    return replaced


def own_gate_up(name: str, linear: nn.Linear) -> bool:
    """Whether ``linear`` is a model's own [gate; up] projection (Phi-3's ``gate_up_proj``, gate
    rows first, as its MLP chunks the output), which packs paired like a fused gate/up. A model
    whose halves came the other way round would fail the lean forward's load probe, not run."""
    return name == OWN_GATE_UP and linear.out_features % 2 == 0
