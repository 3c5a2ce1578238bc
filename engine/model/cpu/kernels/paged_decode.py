"""Decode attention straight over the paged K/V pools (paged_decode.c), and the K/V slot write.

`DecodeStep` is one decode step's attention for every layer, fp32 or bf16, optionally fused with
the rotary and cache write of a decode-only step; `paged_decode_attention` is its one-call form for
a query that is already rotated and written; `write_kv_cache` copies new K/V rows into their slots;
`read_paged_kv` reads the same K/V bytes as a decode step and does nothing else (the benchmark's
floor for attention); `decode_threads` sizes a call's thread count.
"""

from __future__ import annotations

import ctypes

import torch

from engine.model.cpu.kernels.build import load
from engine.model.cpu.kernels.panel_gemm import PanelOperands
from engine.model.cpu.threads import all_threads, threads_for

_DTYPES = (torch.float32, torch.bfloat16)
# A decode kernel call runs multi-threaded from this many visible-key x query-head x head-dim
# multiply-adds (per pass over K or V): about where two threads begin to beat one once the wake-up
# is paid. A lone sequence splits only by KV head (3 tasks for SmolLM2), too few to amortise the
# wake-up even at long contexts (figures: docs/PERFORMANCE.md#thread-wake-ups).
_PARALLEL_MACS = 1e6


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (CPU, fp32 or bf16); callers use torch otherwise."""
    return (
        query.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and query.dtype in _DTYPES
        and k_cache.dtype in _DTYPES
    )


def decode_threads(macs: float) -> int:
    """Threads of a decode kernel call of ``macs`` multiply-adds per pass: inside split_threads
    its count for big enough work, else 1; outside, torch's own count for big enough work."""
    if all_threads():
        return max(1, threads_for(macs, _PARALLEL_MACS))
    return torch.get_num_threads() if macs >= _PARALLEL_MACS else 1


class _DecodeStepStruct(ctypes.Structure):
    """paged_decode.c's DecodeStep."""

    _fields_ = [
        ("batch", ctypes.c_int64),
        ("q_heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("kv_bf16", ctypes.c_int),
        ("act_bf16", ctypes.c_int),
        ("nthreads", ctypes.c_int),
    ]


class DecodeStep:
    """The decode attention of every layer of one step, one C call per layer (the kernel must be
    available). Built once per step: the batch layout is the same for every layer.

    block_tables int32 [B, max_blocks] (rows contiguous), seq_lens int32 [B] context lengths
    including the current token. With ``slots`` (int64 [B]) each layer's rows also carry the new
    token's K and V heads, which the call writes into those slots first, and with ``rotary``
    (cos/sin [B, head_dim]) it rotates the rows' q and k heads first: rotary, cache write and
    attention become one call. Without them the pools must already hold the current token.
    Rows and output are in ``act_dtype`` (fp32 or bf16); arithmetic is fp32. With
    ``time_projection`` a call that runs the qkv panel GEMM also times it (`projection_s`).
    """

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        kv_dtype: torch.dtype,
        num_threads: int,
        act_dtype: torch.dtype = torch.float32,
        slots: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        time_projection: bool = False,
    ) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError("the CPU decode kernel is not available (see the build warning)")
        self._lib = lib
        self._fn = lib.paged_decode_attention
        cos, sin = (table.float().contiguous() for table in rotary) if rotary else (None, None)
        self._keep = (block_tables, seq_lens, slots, cos, sin)  # the struct points into these
        self._struct = _DecodeStepStruct(
            batch=seq_lens.shape[0],
            q_heads=q_heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            block_tables=block_tables.data_ptr(),
            table_stride=block_tables.stride(0),
            seq_lens=seq_lens.data_ptr(),
            slots=None if slots is None else slots.data_ptr(),
            cos=None if cos is None else cos.data_ptr(),
            sin=None if sin is None else sin.data_ptr(),
            kv_bf16=kv_dtype == torch.bfloat16,
            act_bf16=act_dtype == torch.bfloat16,
            nthreads=max(1, num_threads),
        )
        self._ref = ctypes.byref(self._struct)
        self._out = torch.empty((seq_lens.shape[0], q_heads, head_dim), dtype=act_dtype)
        self._out_ptr = self._out.data_ptr()
        self._projection_s = ctypes.c_double(0.0)  # the kernel writes it when given its address
        self._projection_s_ref = ctypes.byref(self._projection_s) if time_projection else None

    @property
    def layout(self) -> object:
        """The C struct of the step, by reference, for kernels that run its attention themselves
        (narrow_decode)."""
        return self._ref

    @property
    def projection_s(self) -> float:
        """Seconds the last call's qkv projection took (time_projection, a call given the GEMM),
        from the call's start to the barrier after it: the team's wake-up included."""
        return self._projection_s.value

    def __call__(
        self,
        rows: torch.Tensor | PanelOperands,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """One layer: rows [B, W] with unit stride (the q heads first, then the new K and V heads
        when the step writes them), or the panel GEMM that computes them from the layer's input
        (fp32; engine.model.cpu.linear.StepGemms.fused_operands), which then runs in the
        attention's parallel region (of the GEMM's threads) and writes its output buffer;
        returns [B, Hq, D], a buffer of this step that the next call overwrites."""
        tail = (k_cache.data_ptr(), v_cache.data_ptr(), self._out_ptr, scale)
        tail += (sliding_window or 0, softcap or 0.0)
        if isinstance(rows, torch.Tensor):
            status = self._fn(self._ref, rows.data_ptr(), rows.stride(0), *tail)
        else:
            x, packed, width, bias, out, threads = rows
            bias_ptr = None if bias is None else bias.data_ptr()
            status = self._lib.decode_qkv_attention(
                self._ref, x.data_ptr(), x.shape[1], packed.data_ptr(), width, bias_ptr,
                out.data_ptr(), *tail, threads, self._projection_s_ref,
            )  # fmt: skip
        if status != 0:
            raise MemoryError("the CPU decode kernel could not allocate its scratch")
        return self._out


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    num_threads: int,
) -> torch.Tensor:
    """Decode attention, one query token per sequence, over the paged cache (which already holds
    the current token's K/V).

    query [B, Hq, D] and k_cache/v_cache [num_blocks, block_size, Hkv, D] (contiguous) each fp32
    or bf16 (arithmetic is fp32 either way); block_tables int32 [B, max_blocks] (rows contiguous);
    seq_lens int32 [B] context lengths including the current token. Returns [B, Hq, D] in query's
    dtype. The caller checks `supports` and `available`.
    """
    _check(query, k_cache, v_cache, block_tables, seq_lens)
    batch, q_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    step = DecodeStep(
        block_tables,
        seq_lens,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        kv_dtype=k_cache.dtype,
        num_threads=num_threads,
        act_dtype=query.dtype,
    )
    rows = query.contiguous().view(batch, q_heads * head_dim)
    return step(rows, k_cache, v_cache, scale, sliding_window, softcap)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Copy key/value [T, Hkv, D] into their slots of the pools as one C call each; False (and
    nothing written) when the tensors are not plain same-dtype CPU rows: the caller uses torch.
    The caller guarantees every slot lies inside the pools (memcpy checks nothing)."""
    lib = load()
    if lib is None or key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        return False
    row = k_cache.shape[2] * k_cache.shape[3]
    for src in (key, value):
        if src.device.type != "cpu" or src.stride(2) != 1 or src.stride(1) != src.shape[2]:
            return False
    row_bytes = row * k_cache.element_size()
    slots = slot_mapping.data_ptr()
    for src, cache in ((key, k_cache), (value, v_cache)):
        stride = src.stride(0) * src.element_size()
        lib.scatter_rows(src.data_ptr(), stride, cache.data_ptr(), slots, src.shape[0], row_bytes)
    return True


def read_paged_kv(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_threads: int,
) -> int | None:
    """Reads what a decode step's attention reads (every layer's K and V rows [0, seq_lens[b]) of
    each sequence, through its block table) and nothing else; returns the XOR of the 64-bit words
    read, None without the kernels. The benchmark times it as attention's floor on this memory."""
    lib = load()
    if lib is None:
        return None
    pools = [pool for kv in kv_caches for pool in kv]
    num_blocks, block_size = pools[0].shape[:2]
    if any(
        p.device.type != "cpu" or not p.is_contiguous() or p.shape != pools[0].shape for p in pools
    ):
        raise ValueError("the pools must be contiguous CPU tensors of one shape")
    _check_tables(block_tables, seq_lens, len(seq_lens))
    # every block a sequence reads, [0, ceil(seq_len / block_size)) of its row
    read = (
        torch.arange(block_tables.shape[1]) < ((seq_lens + block_size - 1) // block_size)[:, None]
    )
    longest = block_tables.shape[1] * block_size
    if not bool(((seq_lens >= 0) & (seq_lens <= longest)).all()) or (
        read.any()
        and not 0 <= int(block_tables[read].min()) <= int(block_tables[read].max()) < num_blocks
    ):
        raise ValueError("a sequence reads past its block table or outside the pools")
    row_bytes = pools[0].stride(1) * pools[0].element_size()
    addresses = (ctypes.c_void_p * len(pools))(*(p.data_ptr() for p in pools))
    return lib.read_paged_kv(
        addresses, len(kv_caches), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), len(seq_lens), block_size, row_bytes, num_threads,
    )  # fmt: skip


def _check(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    if not supports(query, k_cache) or v_cache.dtype != k_cache.dtype:
        raise TypeError("the CPU decode kernel takes fp32 or bf16 CPU tensors")
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: query {tuple(query.shape)}, cache {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    batch, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or q_heads % kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(k_cache.shape)}")
    _check_tables(block_tables, seq_lens, batch)


def _check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int) -> None:
    """block_tables [batch, max_blocks] int32 with contiguous rows, seq_lens [batch] int32
    contiguous, both on the CPU: what the C kernels index without checking."""
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_tables and seq_lens must be int32")
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != batch
        or block_tables.stride(1) != 1
        or seq_lens.shape != (batch,)
        or not seq_lens.is_contiguous()
    ):
        raise ValueError("block_tables must be [B, max_blocks] with contiguous rows, seq_lens [B]")
    if block_tables.device.type != "cpu" or seq_lens.device.type != "cpu":
        raise ValueError("block_tables and seq_lens must be CPU tensors")
