"""Bytes of weights one decode step reads, per weight format, from a GGUF's tensor table; and the
bandwidth bound it sets at concurrency 1 (one token per step: tokens/s <= bandwidth / bytes).

A step reads every matrix once: the layers' projections and the lm_head. With tied embeddings
(no ``output.weight``) the lm_head is ``token_embd``, read whole; with an own lm_head,
``token_embd`` gives one row per token, which we count as nothing. 1-D tensors (norms) stay F32
in every format. KV-cache reads are left out: at C=1 and these prompt lengths they are a few
percent of the weights.
"""

from __future__ import annotations

from pathlib import Path

from engine.model.cpu.quant_formats import GGUF_BLOCKS, NARROWER, record_bytes
from scripts.peers.gguf_header import TensorInfo as Tensor
from scripts.peers.gguf_header import read_header

# Bytes per matrix weight of the plain formats. "gguf": as the file stores it (Q4_1's 20-byte
# blocks of 32, the embedding's Q8_0), what llama-server reads. "int8" and "int4": Modelyard's
# records (fp32 scales, and offsets for int4: 36 and 24 bytes a block of 32, so int4 reads 20%
# more than Q4_1; a Q8_0 tensor as the file holds it, int8h's 34). "auto": Modelyard's default
# on a GGUF, each tensor's own blocks in the matching format, the rest fp32.
FORMATS = ("gguf", "auto", "int8", "int4", "f16", "fp32")
PLAIN_BYTES = {"f16": 2, "fp32": 4}
NORM_BYTES = 4  # per element of a 1-D tensor: F32 in every format


def read_tensors(path: Path) -> list[Tensor]:
    return read_header(path).tensors


# The embedding / tied lm_head: int4 mode keeps it in int8 (engine/model/cpu/quantize.py).
VOCABULARY = ("token_embd.weight", "output.weight")


def matrix_bytes(t: Tensor, fmt: str) -> int:
    """Bytes of the 2-D tensor ``t`` held as ``fmt``."""
    if fmt == "gguf":
        return t.n_bytes
    native = GGUF_BLOCKS.get(t.ggml_type, ("fp32",))[0]
    if fmt == "int4" and t.name in VOCABULARY:
        fmt = "int8"
    if fmt in ("auto", native) or NARROWER.get(fmt) == native:  # the file's blocks as they are
        fmt = native
    if fmt in PLAIN_BYTES:
        return t.n_elements * PLAIN_BYTES[fmt]
    k = t.shape[0]
    return t.n_elements // k * record_bytes(fmt, k)


def bytes_per_token(tensors: list[Tensor], fmt: str) -> int:
    """Bytes of weights a decode step reads when the matrices are stored as ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}: expected one of {FORMATS}")
    tied = not any(t.name == "output.weight" for t in tensors)
    total = 0
    for t in tensors:
        if t.name == "token_embd.weight" and not tied:
            continue  # a row lookup, not a matrix read
        if len(t.shape) < 2:
            total += t.n_bytes if fmt == "gguf" else t.n_elements * NORM_BYTES
        else:
            total += matrix_bytes(t, fmt)
    return total


def bound_tok_s(bandwidth_gb_s: float, nbytes: int) -> float:
    """Decode tokens/s at C=1 if every step streamed its weights at ``bandwidth_gb_s``."""
    return bandwidth_gb_s * 1e9 / nbytes
