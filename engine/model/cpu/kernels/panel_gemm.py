"""fp32 linear layers for decode-sized batches on the C panel GEMM (panel_gemm.c).

`pack` repacks a weight once at load; `linear` runs ``x W^T + b`` on it. engine.model.cpu.linear
takes this path up to `MAX_ROWS` rows where the kernels are built with AVX-512, oneDNN's prepacked
GEMM above.
A [gate; up] weight packed ``paired`` pairs each gate column with its up column in one panel, so
that `linear` can also return the MLP's ``silu(gate) * up`` straight from the GEMM (``gated``).
"""

from __future__ import annotations

import torch

from engine.model.cpu.huge_pages import HugePageArena
from engine.model.cpu.kernels.build import load

# Rows up to which the panel GEMM runs instead of oneDNN's prepacked GEMM, with a margin below
# where oneDNN starts to win (figures: docs/PERFORMANCE.md#panel-gemm).
MAX_ROWS = 128

# A panel GEMM's operands (engine.model.cpu.linear.StepGemms.fused_operands), for a kernel that
# runs the GEMM inside its own parallel region: input [M, K], packed weight, output width N, bias
# [N] or None, output [M, N], threads.
PanelOperands = tuple[torch.Tensor, torch.Tensor, int, "torch.Tensor | None", torch.Tensor, int]


def pack(
    weight: torch.Tensor, paired: bool = False, arena: HugePageArena | None = None
) -> torch.Tensor | None:
    """``weight`` [N, K] (fp32, CPU) in the panel layout, with ``paired`` the [gate; up] layout
    (N even: rows [0, N/2) gate, [N/2, N) up), in memory from ``arena`` when given; None where
    the panel GEMM is not built (no compiler, no AVX-512) or does not apply (another dtype or
    device)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    lib = load()
    if lib is None or not lib.panel_gemm_available():
        return None
    n, k = weight.shape
    if paired and n % 2:
        raise ValueError(f"a paired [gate; up] weight needs an even row count, not {n}")
    half = n // 2 if paired else 0
    source = weight.detach().contiguous()
    size = lib.panel_gemm_packed_size(n, k, half)
    packed = arena.empty(size, torch.float32) if arena else torch.empty(size, dtype=torch.float32)
    lib.panel_gemm_pack(source.data_ptr(), n, k, half, packed.data_ptr())
    return packed


def linear(
    rows: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    threads: int,
    out: torch.Tensor | None = None,
    *,
    paired: bool = False,
    gated: bool = False,
) -> torch.Tensor:
    """``rows`` [M, K] (fp32, contiguous) times the weight `pack` made ``packed`` from (with the
    same ``paired``), plus ``bias`` [out_features] (contiguous) when given, on ``threads``
    threads: [M, out_features], or with ``gated`` (paired only) ``silu(gate) * up`` [M,
    out_features / 2]; written into ``out`` (fp32, contiguous, that shape) when given."""
    if gated and not paired:
        raise ValueError("gated needs a paired weight")
    m, k = rows.shape
    half = out_features // 2 if paired else 0
    if out is None:
        out = torch.empty((m, half if gated else out_features), dtype=torch.float32)
    load().panel_gemm(
        rows.data_ptr(),
        m,
        k,
        packed.data_ptr(),
        out_features,
        half,
        gated,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        threads,
    )
    return out
