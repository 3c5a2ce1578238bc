"""The runner's one entry to the CPU speed-ups: `prepare_cpu_fast_path` readies a loaded model
for CPU speed once, and the `CpuFastPath` it returns answers the runner's per-step questions.

At load: torch's intra-op thread count, the linears on narrow weights where ``--quantization``
asks for them (`narrow_weights`), and every other linear replaced by prepacked GEMMs
(`engine.model.cpu.linear`: oneDNN-blocked weights, fp32 panels for the C panel GEMM, q/k/v and
gate/up fused) where oneDNN supports the dtype. Per forward: which ops get every thread
(`step_threads`). Once, after the runner measured its KV budget: the lean Llama forward
(`lean_forward`), which the runner keeps only if it reproduces the transformers forward.

Off the fast path, the CPU pieces reached without it: the "cpu" attention backend
(`engine.model.attention.cpu_backend`, chosen with the others by engine.model.attention.backends),
the sampler's argmax kernel (through engine.model.sampling_ops), and
`engine.model.cpu.openmp_env`, which must run before torch loads.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from engine import startup
from engine.config import EngineConfig
from engine.model.cpu.decode_threads import DecodeThreads
from engine.model.cpu.lean_forward import LeanLlamaForward
from engine.model.cpu.linear import prepack_linears, prepack_supported
from engine.model.cpu.narrow_weights import narrow_weights
from engine.model.cpu.quantize import QuantizedModel
from engine.model.cpu.threads import split_threads
from engine.model.loader import LoadedModel

# torch parallelises an elementwise op from this many elements (at::internal::GRAIN_SIZE).
_ELEMENTWISE_GRAIN = 32768
# From this many elements per activation row set (tokens x hidden) the elementwise ops are big
# enough to pay for waking the other threads (figures: docs/PERFORMANCE.md#thread-wake-ups).
_ELEMENTWISE_PARALLEL = 256 * 576


class CpuFastPath:
    """A model prepared by `prepare_cpu_fast_path`."""

    def __init__(
        self,
        model: nn.Module,
        threads: int,
        num_prepacked: int,
        narrow: QuantizedModel | None = None,
    ) -> None:
        self.threads = threads  # intra-op threads of big ops (small ones run on one: step_threads)
        self.decode_threads = DecodeThreads(threads)
        self._team = threads  # torch's thread count now
        self.num_prepacked = num_prepacked  # dense GEMMs that replaced the model's linears
        self.narrow = narrow  # what went onto narrow weights (None: nothing)
        self._model = model
        self._hidden_size = model.get_input_embeddings().embedding_dim

    @contextlib.contextmanager
    def step_threads(self, num_tokens: int, decode: bool) -> Iterator[None]:
        """The thread policy of a forward over ``num_tokens`` tokens (``decode``: one a
        sequence). Its team: for a decode step one thread or all, whichever `decode_threads`
        finds faster now, else all. Once the model's elementwise ops get big enough for torch to
        parallelise them (activations of ``_ELEMENTWISE_GRAIN`` elements), they run on one thread
        and only GEMMs and big attention calls on the team, until they are big enough to gain
        from every thread themselves (``_ELEMENTWISE_PARALLEL``, prefill-sized steps); below the
        grain, switching thread counts per GEMM costs more than it saves
        (docs/PERFORMANCE.md#thread-wake-ups), so everything keeps the team."""
        threads = self.decode_threads.choose(num_tokens) if decode else self.threads
        if threads != self._team:
            torch.set_num_threads(threads)
            self._team = threads
        elements = num_tokens * self._hidden_size
        split = threads > 1 and _ELEMENTWISE_GRAIN <= elements < _ELEMENTWISE_PARALLEL
        started = time.perf_counter()
        with split_threads(threads) if split else contextlib.nullcontext():
            yield
        if decode:
            self.decode_threads.observe(num_tokens, threads, time.perf_counter() - started)

    def lean_forward(self) -> LeanLlamaForward | None:
        """The lean forward of the prepared model, when its architecture and prepacked linears
        allow one; the runner checks it against the transformers forward before using it."""
        return LeanLlamaForward.build(self._model)


def prepare_cpu_fast_path(loaded: LoadedModel, config: EngineConfig) -> CpuFastPath | None:
    """Ready ``loaded``'s model for CPU speed (its narrow weights cached by its source folder,
    a GGUF's blocks taken from ``loaded.gguf``, which is then cleared); None off the CPU."""
    if loaded.device.type != "cpu":
        return None
    model, dtype = loaded.model, loaded.dtype
    threads = max(1, config.num_threads or len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    gguf, loaded.gguf = loaded.gguf, None  # its blocks become the model's
    with startup.phase("narrow weights"):
        narrow = narrow_weights(model, dtype, config, Path(loaded.source), gguf)
    num_prepacked = 0
    if prepack_supported(loaded.device, dtype):
        with startup.phase("prepack"):
            num_prepacked = prepack_linears(model, batch_size_hint=config.max_num_seqs)
    return CpuFastPath(model, threads, num_prepacked, narrow)
