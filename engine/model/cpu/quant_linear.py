"""Linear layers and embeddings on narrow weights (engine.model.cpu.quant_formats), for CPUs.

A decode step reads every weight once, so at small batches its time is the bytes of the weights
over the memory bandwidth: int8 reads a quarter of fp32's bytes and int4 about a sixth. The
`QuantizedLinear` GEMMs run in C (kernels/quant_gemm.c) on the weight in the kernel's layout; the
embedding keeps the column records (one per token) and dequantises only the rows it looks up; tied
to a narrow lm_head (`QuantizedEmbedding.tie_to`), it looks them up in the head's kernel layout
instead of holding the same values twice (170 MiB of Gemma 3 270M's 262,144-token table).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from engine.model.cpu.kernels import quant_gemm
from engine.model.cpu.packed_cache import PackedSlots
from engine.model.cpu.quant_formats import QuantizedWeight
from engine.model.cpu.threads import all_threads


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with W a QuantizedWeight; activations fp32 (any leading shape).
    ``paired``: the weight is an MLP's [gate; up] (rows [0, N/2) gate), which
    `engine.model.cpu.linear.StepGemms` can then run with the activation inside the GEMM.
    ``slots``: where the load's packed weights come from (the packed cache's file)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        lib: ctypes.CDLL,
        paired: bool = False,
        slots: PackedSlots | None = None,
    ) -> None:
        super().__init__()
        self.fmt = weight.fmt
        self.in_features, self.out_features = weight.in_features, weight.out_features
        packed = quant_gemm.pack(lib, weight) if slots is None else slots.pack(self, weight)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().float().contiguous(), persistent=False
        )
        self._lib = lib
        self.paired = paired

    def narrow(self) -> quant_gemm.NarrowLinear:
        """This GEMM for kernels that run it inside their own parallel region: pointers into
        this module's tensors, valid until they move (parking repoints them)."""
        return quant_gemm.narrow_linear(
            self.fmt, self.packed, self.out_features, self.in_features, self.bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float().contiguous()
        threads = all_threads() or torch.get_num_threads()
        gemm = quant_gemm.gemm
        y = gemm(self._lib, self.fmt, rows, self.packed, self.out_features, self.bias, threads)
        return y.view(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"


class QuantizedEmbedding(nn.Module):
    """An embedding table held as a QuantizedWeight (one record per token), or read from the
    lm_head it is tied to; lookups return fp32 rows, or ``dtype`` rows, times ``scale`` where
    given (Gemma scales its embeddings)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.fmt = weight.fmt
        self.embedding_dim = weight.in_features
        self.num_embeddings = weight.out_features
        self.dtype = dtype
        self.scale = scale
        self.register_buffer("records", weight.records, persistent=False)
        self._head: QuantizedLinear | None = None

    def tie_to(self, head: QuantizedLinear) -> None:
        """Look rows up in ``head``'s packed weight, which holds this table's values (an lm_head
        tied to the embedding), and let the records go. The head stays the model's module, not a
        submodule of this one; parking moves its tensors in place, so lookups follow them."""
        if (head.fmt, head.in_features, head.out_features) != (
            self.fmt,
            self.embedding_dim,
            self.num_embeddings,
        ):
            raise ValueError("the lm_head is not this embedding's table")
        object.__setattr__(self, "_head", head)
        self.records = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        head = self._head
        if head is None:
            rows = QuantizedWeight(self.fmt, self.embedding_dim, self.records).dequantize(flat)
        else:
            n, k = self.num_embeddings, self.embedding_dim
            rows = quant_gemm.unpack_rows(head._lib, self.fmt, head.packed, n, k, flat)
        if self.scale is not None:
            rows = rows * self.scale
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        tied = ", read from the lm_head" if self._head is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}{tied}"
