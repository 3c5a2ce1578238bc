"""The lean forward's elementwise glue as single C calls (fp32/bf16 CPU), torch ops elsewhere.

Between two GEMMs of a decode step each torch op costs far more in dispatch than in arithmetic,
much of it re-fetching code the GEMM's weight stream evicted from the caches (figures:
docs/PERFORMANCE.md#per-op-overhead); transformers' RMSNorm alone is ~6 ops. One C call does the
residual add and the norm, another the rotary embedding of every q/k head in place, a third the
MLP's ``silu(gate) * up``. The torch versions compute the same thing for the other dtypes and when
no compiler is found. (bf16: the C versions compute in fp32 and round each result once, where
torch's bf16 ops round after every op; the lean forward's load-time check bounds the difference.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.cpu.kernels.build import DTYPE_SUFFIXES, load
from engine.model.cpu.threads import all_threads, threads_for

# Elements from which a fused op runs on every thread of the split_threads section.
_PARALLEL_ELEMENTS = 1 << 16


class FusedOps:
    """``add_rms_norm`` and ``rope`` for tensors of one dtype on one device (``StepOps`` binds them,
    and ``silu_mul``, to one forward pass)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        suffix = DTYPE_SUFFIXES.get(dtype) if device.type == "cpu" else None
        self._lib = load() if suffix else None
        if self._lib is not None:
            self._norm = getattr(self._lib, "add_rms_norm_" + suffix)
            self._rope = getattr(self._lib, "rope_" + suffix)
            self._silu_mul = getattr(self._lib, "silu_mul_" + suffix)

    @property
    def uses_kernels(self) -> bool:
        return self._lib is not None

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += delta`` in place (when given), then ``weight * x / rms(x)`` over the last dim.
        x [T, H] contiguous; delta [T, H]."""
        if self._lib is None:
            if delta is not None:
                x.add_(delta)
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        if delta is not None:
            delta = delta.contiguous()
        out = torch.empty_like(x)
        rows, hidden = x.shape
        self._norm(
            x.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            _threads(x.numel()),
        )
        return out

    def rotary_tables(
        self, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's cos/sin [T, head_dim] (as transformers' rotary module returns them) in the form
        `rope` takes; computed once per step, used by every layer."""
        if self._lib is not None:
            return cos.contiguous(), sin.contiguous()
        half = cos.shape[-1] // 2
        # rotate_half(x) * sin == (x with its halves swapped) * (sin, first half negated)
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos[:, None], signed[:, None]

    def rope(
        self,
        qkv: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        heads: int,
        head_dim: int,
    ) -> torch.Tensor:
        """Rotary embedding of the first ``heads`` heads of every row of qkv [T, W] (rows
        contiguous). Returns those heads rotated, [T, heads, head_dim] (a view of qkv on the
        kernel path, which rotates in place)."""
        tokens = qkv.shape[0]
        qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        cos, sin = tables
        if self._lib is None:
            swapped = qk.view(tokens, heads, 2, head_dim // 2).flip(2).view_as(qk)
            return torch.addcmul(qk * cos, swapped, sin)
        self._rope(
            qkv.data_ptr(),
            qkv.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            tokens,
            heads,
            head_dim,
            _threads(tokens * heads * head_dim),
        )
        return qk


class StepOps:
    """The fused ops of one forward pass bound to its residual stream x [T, H] (updated in place):
    output buffers allocated once per pass and reused by every layer, pointers and thread counts
    resolved once, so that each call between two GEMMs is one ctypes call: right after a GEMM a
    `FusedOps` call's allocation and tensor queries re-fetch code and data the GEMM evicted, and
    cost more than the bare call (figures: docs/PERFORMANCE.md#per-op-overhead).

    A returned tensor is overwritten by the next call of the same method: the lean forward consumes
    each one (by a GEMM) before that. Inputs (GEMM outputs) must be contiguous."""

    def __init__(self, ops: FusedOps, x: torch.Tensor, mlp_width: int) -> None:
        self._ops = ops
        self.x = x
        self._lib = ops._lib
        if self._lib is None:
            return
        rows, hidden = x.shape
        self._h = torch.empty_like(x)
        self._act = torch.empty((rows, mlp_width), dtype=x.dtype)
        # ctypes arguments of every call but the per-call delta/gate_up pointer and weight
        self._norm_args = (x.data_ptr(), self._h.data_ptr(), rows, hidden, _threads(x.numel()))
        threads = _threads(rows * mlp_width // 4)  # cheap per element: parallel from 4x the size
        self._silu_args = (self._act.data_ptr(), rows, mlp_width, threads)

    def add_rms_norm(
        self, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += delta`` (when given), then the RMSNorm of x with ``weight``."""
        if self._lib is None:
            return self._ops.add_rms_norm(self.x, delta, weight, eps)
        x_ptr, out_ptr, rows, hidden, threads = self._norm_args
        delta_ptr = None if delta is None else delta.data_ptr()
        self._ops._norm(x_ptr, delta_ptr, weight.data_ptr(), out_ptr, rows, hidden, eps, threads)
        return self._h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of rows ``[gate | up]``: gate_up [T, 2W] -> [T, W]."""
        if self._lib is None:
            width = gate_up.shape[1] // 2
            return F.silu(gate_up[:, :width]).mul_(gate_up[:, width:])
        out_ptr, rows, width, threads = self._silu_args
        self._ops._silu_mul(gate_up.data_ptr(), out_ptr, rows, width, threads)
        return self._act


def _threads(elements: int) -> int:
    """Inside split_threads: its count for big ops, else 1. Outside (decode-sized steps run
    everything on every thread, prefill-sized ones too): torch's count for big ops."""
    if all_threads():
        return max(1, threads_for(elements, _PARALLEL_ELEMENTS))
    return torch.get_num_threads() if elements >= _PARALLEL_ELEMENTS else 1
