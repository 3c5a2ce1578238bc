"""What both sides of bench_density share: the file, the budget, each copy's context, the bounds
of every loop, and the request round's shape."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.peers.model_file import ModelFile, kv_bytes_per_token

BLOCK_TOKENS = 16  # the engine's default --block-size: its KV budget is whole blocks


@dataclass(frozen=True)
class Settings:
    model: ModelFile
    budget_bytes: int
    max_copies: int
    context: int  # tokens of KV cache each copy holds (llama-server -c, the engine's KV budget)
    clients: int
    requests: int
    max_tokens: int
    fill_seconds: float  # no copy is started after this many seconds of a side's fill
    round_seconds: float
    load_timeout: float  # one copy's start
    log_dir: Path

    def copy_names(self) -> list[str]:
        return [f"{self.model.name}-{i}" for i in range(self.max_copies)]

    def kv_cache_bytes(self) -> int:
        """The engine's KV budget that holds ``context`` tokens (fp32 K and V, whole blocks)."""
        blocks = -(-self.context // BLOCK_TOKENS)
        return blocks * BLOCK_TOKENS * kv_bytes_per_token(self.model.path)

    def engine(self) -> dict[str, Any]:
        """Every copy's engine settings in models.yaml (residency_bench.gateway.models_yaml):
        one context of KV shared by up to ``clients`` sequences, like llama-server's unified
        cache; an idle TTL no run reaches (only the budget parks)."""
        return {
            "kv_cache_memory": self.kv_cache_bytes(),
            "max_model_len": self.context,
            "max_num_seqs": self.clients,
            "idle_ttl_s": 86400,
            "queue": {"max_requests": 64, "max_wait_s": self.load_timeout},
        }
