"""RMSNorm modules replaced by torch's fused ``F.rms_norm`` where that computes the same thing.

transformers' RMSNorm runs ~8 tensor ops per call (upcast, pow, mean, add, rsqrt, mul, downcast,
scale); at decode sizes each op costs mostly dispatch, and a 30-layer model calls 61 norms per
step. A module is swapped only after its output on a random probe matches the fused op's, so
variants with other formulas (Gemma's ``1 + weight`` scale, for one) keep their own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PROBE_ROWS = 4
# (rtol, atol) per dtype; other dtypes keep the original module. bf16's looser bound still tells
# ``w * x / rms`` from e.g. Gemma's ``(1 + w) * x / rms`` (weights probe at ~1, outputs at ~3).
_TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2)}


class FusedRMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, one fused op."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight  # the original parameter, shared
        self.eps = eps
        self.normalized_shape = (weight.shape[0],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, fused"


def _candidate(module: nn.Module) -> FusedRMSNorm | None:
    if "RMSNorm" not in type(module).__name__ or list(module.children()):
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    tolerance = _TOLERANCE.get(weight.dtype)
    if tolerance is None:
        return None
    fused = FusedRMSNorm(weight, eps)
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(_PROBE_ROWS, weight.shape[0], generator=generator, dtype=weight.dtype)
    probe = probe.to(weight.device) * 3.0
    with torch.no_grad():
        expected, got = module(probe), fused(probe)
    rtol, atol = tolerance
    if expected.shape != got.shape or not torch.allclose(expected, got, rtol=rtol, atol=atol):
        return None
    return fused


def fuse_rms_norms(model: nn.Module) -> int:
    """Swap every RMSNorm of ``model`` that the fused op reproduces; return how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            fused = _candidate(child)
            if fused is not None:
                setattr(parent, name, fused)
                swapped += 1
    return swapped
