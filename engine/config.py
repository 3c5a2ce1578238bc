"""Engine configuration: one dataclass shared by the CLI, the offline API and the core."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance."""

    model: str
    gguf_file: str | None = None
    # auto | float32 | float16 | bfloat16 (auto: bf16/fp16 on CUDA, fp32 on CPU)
    dtype: str = "auto"
    # auto | none | int8 | int4: narrow CPU weights (engine.model.cpu.quantize); auto: a GGUF
    # file's own Q8_0 / Q4_0 / Q4_1 blocks where they are, the rest as --dtype
    quantization: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    # auto (the model's dtype) | float32 | float16 | bfloat16: a narrower cache holds more tokens
    # and halves the bytes decode attention reads; attention still computes in the model's dtype
    kv_cache_dtype: str = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    kv_cache_memory: int = 512 * 2**20  # bytes, CPU budget
    gpu_memory_fraction: float = 0.9  # CUDA: share of the card this process may use
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # CPU torch threads; None = physical cores available
    max_queue: int = 1024  # waiting sequences beyond which the server sheds load
    max_n: int = 128  # choices (n) one request may ask for: OpenAI's own limit
    # Structured outputs (engine.structured): a compile's wall-clock limit in its worker process,
    # the grammar memory (cached and in use) and the worker processes
    structured_compile_timeout_s: float = 5.0
    structured_cache_memory: int = 256 * 2**20
    structured_compile_workers: int = 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError("gpu_memory_fraction must be in (0, 1]")
        if self.max_queue < 1 or self.max_n < 1:
            raise ValueError("max_queue and max_n must be >= 1")
        if not self.structured_compile_timeout_s > 0 or self.structured_compile_workers < 1:
            raise ValueError("structured compiles need a positive timeout and at least one worker")
