"""Model runner: runs one step of a transformers model over the paged KV cache.

The model keeps its own modules; only attention is ours (engine.model.transformers_attention). The
forward runs with use_cache=False on one flattened row holding every scheduled token of every
sequence (`StepBatch`); the step's metadata and the KV pools reach every attention call in a
`StepContext`. On CPU the model is first readied by the CPU fast path (engine.model.cpu), which
may also offer a lean forward that the runner keeps only where it reproduces transformers' logits.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from typing import TYPE_CHECKING

import torch

from engine import startup
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.model.attention.backends import select_backend
from engine.model.attention.metadata import AttentionMetadata
from engine.model.cache_dir import wait_for_writes
from engine.model.cpu.fast_path import prepare_cpu_fast_path
from engine.model.fast_norms import fuse_rms_norms
from engine.model.footprint import MemoryFootprint, ParkRecord, activation_estimate
from engine.model.host_memory import trim_heap
from engine.model.kv_cache import KVCacheSpec, allocate_kv_cache, num_blocks_for_budget
from engine.model.loader import LoadedModel, cache_root, resolve_dtype
from engine.model.park.weights import WeightParker
from engine.model.step_batch import StepBatch
from engine.model.step_context import CONTEXT_KWARG, StepContext
from engine.model.step_profile import StepProfile

if TYPE_CHECKING:
    from engine.model.cpu.lean_forward import LeanLlamaForward

log = logging.getLogger(__name__)

# Largest logit difference, relative to the largest logit, at which the lean forward counts as the
# same computation as transformers' (reordered sums differ by ~1e-6 relative in fp32; in bf16 every
# rounding of an activation is worth ~4e-3, and SmolLM2's 30 layers drifted by 0.97 of a largest
# logit of 29.8). A structural mistake (rotary, norm, residual) moves logits by a large fraction of
# their scale.
_LEAN_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
# On narrow weights the GEMMs round their input activations to int8 (1/127 of a block's largest);
# sums in another order put a value across a rounding boundary now and then, and 30 layers spread
# that (SmolLM2-135M int4: 5e-2 of the largest logit).
_NARROW_LEAN_TOLERANCE = 1e-1


class ModelRunner:
    """Owns the model, its (prepacked) linears and the KV pools; runs one step at a time."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> None:
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = config.block_size
        self.profile = StepProfile()  # off: benchmarks turn it on (engine.model.step_profile)
        # CPU: thread count and prepacked linears (None on other devices)
        self.cpu = prepare_cpu_fast_path(loaded, config)
        # rebuilt from its snapshot (engine.model.skeleton): the lean forward runs, as checked at
        # an earlier start; transformers' forward is not there to run
        self.snapshot = loaded.snapshot
        restored = self.snapshot is not None and self.snapshot.restored
        if not restored:
            # imported here: it registers with transformers' attention interface, whose import
            # is transformers' modeling
            from engine.model.transformers_attention import use_paged_attention

            use_paged_attention(self.model)
        # Chosen once; every step's StepContext carries it to the attention calls.
        self.attention_backend = select_backend(self.device)
        self.num_fused_norms = fuse_rms_norms(self.model)
        self.spec = KVCacheSpec(
            num_layers=loaded.num_layers,
            block_size=config.block_size,
            num_kv_heads=loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            dtype=self._kv_cache_dtype(),
        )
        self.lean: LeanLlamaForward | None = None
        if restored:
            self.lean = self._restored_lean_forward()
        self.activation_bytes: int | None = None  # CUDA: measured by _kv_budget_bytes
        with startup.phase("kv probe"):
            budget = self._kv_budget_bytes(max_model_len)
        if not restored:
            with startup.phase("lean check"):
                self.lean = self._checked_lean_forward()
            if self.lean is not None and self.snapshot is not None:
                self.snapshot.save()
        self.num_blocks = num_blocks_for_budget(self.spec, budget, max_model_len)
        with startup.phase("kv cache"):  # committed now: the first touch of its pages
            self.kv_caches = allocate_kv_cache(self.spec, self.num_blocks, self.device)
        # sleep and wake: every object that holds weights is a root of the parker's walk
        narrow = self.cpu.narrow if self.cpu is not None else None
        self._packed_file = narrow.mapped if narrow is not None else None
        self.parker = WeightParker(
            [self.model, self.lean, self.cpu], self.device, cache_root() / "park", self._packed_file
        )
        self.sleeping = False
        self._park_record = ParkRecord()
        self._weights_bytes = self.parker.resident_bytes()
        with startup.phase("cache writes"):  # started by the load, finished while it went on
            wait_for_writes()
        # The load's garbage (the tokenizer's parsed JSON, the probes' and conversions' buffers)
        # sits in glibc's heap below its mmap threshold, counted in RSS until trimmed: 45 MB
        # for Gemma 3 270M.
        trim_heap()

    # ----------------------------------------------------------------- sizing and probing
    def _kv_cache_dtype(self) -> torch.dtype:
        if self.config.kv_cache_dtype == "auto":
            return self.loaded.dtype
        dtype = resolve_dtype(self.config.kv_cache_dtype, self.device)
        if self.device.type == "cuda" and dtype != self.loaded.dtype:
            raise ModelLoadError(
                f"kv_cache_dtype {self.config.kv_cache_dtype} differs from the model's "
                f"{self.loaded.dtype}: on CUDA the KV cache takes the model's dtype",
                param="kv_cache_dtype",
            )
        return dtype

    def _kv_budget_bytes(self, max_model_len: int) -> int:
        """CPU: the configured bytes. CUDA: the card's share minus weights and activation peak."""
        if self.device.type != "cuda":
            self._probe(num_tokens=8, max_model_len=max_model_len)
            return self.config.kv_cache_memory
        device = self.device
        torch.cuda.set_per_process_memory_fraction(self.config.gpu_memory_fraction, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        weights = torch.cuda.memory_allocated(device)
        probe_cache_bytes = self._probe(self.config.max_num_batched_tokens, max_model_len)
        torch.cuda.synchronize(device)
        activations = torch.cuda.max_memory_allocated(device) - weights - probe_cache_bytes
        self.activation_bytes = activations
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(self.config.gpu_memory_fraction * total) - weights - activations
        log.info(
            "CUDA memory: %.0f MiB allowed, weights %.0f MiB, activation peak %.0f MiB, "
            "KV budget %.0f MiB",
            self.config.gpu_memory_fraction * total / 2**20,
            weights / 2**20,
            activations / 2**20,
            budget / 2**20,
        )
        return budget

    def _probe(self, num_tokens: int, max_model_len: int) -> int:
        """Run a dummy forward of ``num_tokens`` prompt tokens over a throwaway cache.

        Checks that every layer's attention goes through our function (a model that bypasses the
        attention interface cannot be served) and, on CUDA, sets the activation peak.
        Returns the bytes of the throwaway cache.
        """
        seq_len = max(1, min(num_tokens, max_model_len))
        num_seqs = -(-num_tokens // seq_len)
        query_lens = [seq_len] * num_seqs
        blocks_per_seq = self.spec.blocks_for_tokens(seq_len)
        caches = allocate_kv_cache(self.spec, num_seqs * blocks_per_seq, self.device)
        tables = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)
        ]
        batch = StepBatch(
            input_ids=[0] * sum(query_lens),
            positions=[p for q in query_lens for p in range(q)],
            query_lens=query_lens,
            seq_lens=query_lens,
            block_tables=tables,
            sample_rows=list(range(seq_len - 1, sum(query_lens), seq_len)),
        )
        ctx = self._context(batch, caches)
        self._forward(batch, ctx)
        if len(ctx.layers_called) != self.spec.num_layers:
            raise ModelLoadError(
                f"unsupported architecture {type(self.model).__name__}: "
                f"{len(ctx.layers_called)} of {self.spec.num_layers} layers route attention "
                "through transformers' attention interface"
            )
        return sum(k.numel() * k.element_size() * 2 for k, _ in caches)

    def _restored_lean_forward(self) -> LeanLlamaForward:
        """The lean forward of a model rebuilt from its snapshot. A snapshot is written only once
        the same code's lean forward passed its check on transformers' model: one that does not
        give a lean forward is discarded, so that the next start checks again."""
        lean = self.cpu.lean_forward() if self.cpu is not None else None
        if lean is None:
            self.snapshot.discard()
            raise ModelLoadError(
                f"the model rebuilt from {self.snapshot.path} runs no lean forward (logged above); "
                "that snapshot is removed, and the next start builds transformers' model"
            )
        log.info("lean forward in use (checked against transformers at an earlier start)")
        return lean

    def _checked_lean_forward(self) -> LeanLlamaForward | None:
        """The lean forward when the model supports it and it reproduces the transformers path's
        logits on a probe (a two-sequence prefill, then one decode step of each)."""
        lean = self.cpu.lean_forward() if self.cpu is not None else None
        if lean is None:
            return None
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(self.loaded.vocab_size, (16,), generator=generator).tolist()
        blocks = self.spec.blocks_for_tokens(10)
        tables = [list(range(blocks)), list(range(blocks, 2 * blocks))]
        steps = [
            StepBatch(ids[:14], [*range(9), *range(5)], [9, 5], [9, 5], tables, [8, 13]),
            StepBatch(ids[14:], [9, 5], [1, 1], [10, 6], tables, [0, 1]),
        ]
        logits = {}
        for path in (None, lean):
            self.lean = path
            caches = allocate_kv_cache(self.spec, 2 * blocks, self.device)
            logits[path] = [self._forward(b, self._context(b, caches)) for b in steps]
        self.lean = None
        worst = max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(logits[None], logits[lean], strict=True)
        )
        scale = max(a.float().abs().max().item() for a in logits[None])
        # The narrower of the model's and the cache's dtype sets how far roundings may drift apart.
        dtypes = (self.loaded.dtype, self.spec.dtype)
        tolerance = max(_LEAN_TOLERANCE.get(dtype, 0.0) for dtype in dtypes)
        if self.cpu.narrow is not None:
            tolerance = max(tolerance, _NARROW_LEAN_TOLERANCE)
        if worst > tolerance * max(1.0, scale):
            log.warning(
                "lean forward differs from transformers' (max |logit diff| %.2e, largest logit "
                "%.1f): not used",
                worst,
                scale,
            )
            return None
        log.info(
            "lean forward in use (max |logit diff| vs transformers %.1e, largest logit %.1f)",
            worst,
            scale,
        )
        return lean

    # ----------------------------------------------------------------- sleep and wake
    def sleep(self) -> None:
        """Release the weights (engine.model.park) and the KV pools; no-op when asleep. Weights
        go first: a park that fails (disk full) leaves the runner as it was."""
        if self.sleeping:
            return
        started = time.perf_counter()
        kv_bytes = self._kv_cache_bytes()
        moved = self.parker.park()
        self.kv_caches = allocate_kv_cache(self.spec, 0, self.device)
        trim_heap()  # what was freed below glibc's mmap threshold (pools, once it has grown)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        seconds = time.perf_counter() - started
        self.sleeping = True
        self._weights_bytes = moved.resident_after
        self._park_record = self._park_record.parked(seconds, moved.resident_before)
        log.info(
            "asleep in %.2f s: %.0f MiB of weights released (%.0f MiB written to the park), "
            "%.0f MiB of KV cache freed",
            seconds,
            moved.resident_before / 2**20,
            moved.copied / 2**20,
            kv_bytes / 2**20,
        )

    def wake_up(self) -> None:
        """Weights back into memory, zeroed KV pools of the same block count; no-op when awake."""
        if not self.sleeping:
            return
        started = time.perf_counter()
        moved = self.parker.wake()
        weights_s = time.perf_counter() - started
        self.kv_caches = allocate_kv_cache(self.spec, self.num_blocks, self.device)
        seconds = time.perf_counter() - started
        self.sleeping = False
        self._weights_bytes = moved.resident_after
        self._park_record = self._park_record.woke(seconds)
        log.info(
            "awake in %.2f s: %.0f MiB of weights copied back in %.2f s (%.1f GB/s), %.0f MiB of "
            "KV cache zeroed in %.2f s",
            seconds,
            moved.copied / 2**20,
            weights_s,
            moved.copied / max(weights_s, 1e-9) / 1e9,
            self._kv_cache_bytes() / 2**20,
            seconds - weights_s,
        )

    def footprint(self) -> MemoryFootprint:
        """What the runner holds now (cheap: no walk; the weights were measured at load, park
        and wake)."""
        device = self.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        measured = self.activation_bytes is not None
        packed = self._packed_file
        return MemoryFootprint(
            device=str(device),
            sleeping=self.sleeping,
            weights_bytes=self._weights_bytes,
            kv_cache_bytes=self._kv_cache_bytes(),
            activation_bytes=self.activation_bytes if measured else self._activation_estimate(),
            activation_measured=measured,
            park=self._park_record,
            mapped_weights=None if packed is None else (packed.address, packed.nbytes),
        )

    def _kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pools in self.kv_caches for t in pools)

    def _activation_estimate(self) -> int:
        text = self.loaded.hf_config
        text = text.get_text_config() if hasattr(text, "get_text_config") else text
        heads = text.num_attention_heads
        return activation_estimate(
            tokens=self.config.max_num_batched_tokens,
            hidden=text.hidden_size,
            intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
            qkv_width=(heads + 2 * self.spec.num_kv_heads) * self.spec.head_dim,
            sampled_rows=self.config.max_num_seqs,
            vocab=self.loaded.vocab_size,
            itemsize=self.loaded.dtype.itemsize,
        )

    # ------------------------------------------------------------------------ one step
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run the step; logits [R, vocab] (the model's dtype) for its ``sample_rows``."""
        if batch.copy_ops:
            self._copy_blocks(batch.copy_ops)
        profile = self.profile if self.profile.enabled else None
        return self._forward(batch, self._context(batch, self.kv_caches, profile))

    def _context(
        self,
        batch: StepBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        profile: StepProfile | None = None,
    ) -> StepContext:
        """The step's StepContext; its attention calls are booked in ``profile`` when given."""
        meta = AttentionMetadata.from_lists(
            batch.query_lens, batch.seq_lens, batch.block_tables, self.block_size, self.device
        )
        return StepContext(
            meta=meta,
            kv_caches=kv_caches,
            backend=self.attention_backend,
            profile=profile,
        )

    def compute_threads(
        self, num_tokens: int, decode: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """The thread policy of a forward over ``num_tokens`` tokens, ``decode``: one a
        sequence (CPU: engine.model.cpu.fast_path.CpuFastPath.step_threads; elsewhere torch's
        own)."""
        if self.cpu is None:
            return contextlib.nullcontext()
        return self.cpu.step_threads(num_tokens, decode)

    def _forward(self, batch: StepBatch, ctx: StepContext) -> torch.Tensor:
        decode = all(n == 1 for n in batch.query_lens)
        with self.compute_threads(len(batch.input_ids), decode):
            return self._forward_body(batch, ctx)

    @torch.no_grad()  # not inference_mode: fused projections check tensors' version counters
    def _forward_body(self, batch: StepBatch, ctx: StepContext) -> torch.Tensor:
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long).to(self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long).to(self.device)
        rows = None
        if batch.sample_rows:
            rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
        if self.lean is not None:
            logits = self.lean(input_ids, positions, ctx, rows)
        else:
            logits = self._transformers_forward(input_ids, positions, ctx, rows)
        if logits is None:  # prefill chunks only: the KV cache is filled, nothing to sample yet
            return torch.empty(0, self.loaded.vocab_size, device=self.device)
        return logits

    def _transformers_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: StepContext,
        rows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The model's own forward, our attention inside; logits of ``rows``."""
        kwargs = {
            "input_ids": input_ids[None],
            "position_ids": positions[None],
            "use_cache": False,
            CONTEXT_KWARG: ctx,
        }
        if rows is None:
            self.model.base_model(**kwargs)
            return None
        if self._keeps_logits:
            # The model's own head (with any final soft-capping or scaling) on the needed rows only.
            return self.model(**kwargs, logits_to_keep=rows).logits[0]
        return self.model(**kwargs).logits[0].index_select(0, rows)

    @functools.cached_property
    def _keeps_logits(self) -> bool:
        return "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def _copy_blocks(self, copy_ops: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copy_ops], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copy_ops], dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
