"""What the engine holds in memory, as a supervisor plans with it (GET /status), and the record of
its parks and wakes."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ParkRecord:
    """Parks and wakes so far; the last of each, in seconds; weight bytes the last park released."""

    parks: int = 0
    wakes: int = 0
    last_park_s: float | None = None
    last_wake_s: float | None = None
    weight_bytes_parked: int = 0

    def parked(self, seconds: float, weight_bytes: int) -> ParkRecord:
        return replace(
            self, parks=self.parks + 1, last_park_s=seconds, weight_bytes_parked=weight_bytes
        )

    def woke(self, seconds: float) -> ParkRecord:
        return replace(self, wakes=self.wakes + 1, last_wake_s=seconds)


@dataclass(frozen=True)
class MemoryFootprint:
    """One snapshot, taken on the engine thread after load and after every park and wake."""

    device: str  # "cpu" or "cuda:N"
    sleeping: bool
    weights_bytes: int  # unique weight storages in process (device) memory now
    kv_cache_bytes: int  # the KV pools now
    activation_bytes: int  # one step's activations at most: see activation_measured
    activation_measured: bool  # CUDA: the probe's measured peak; CPU: `activation_estimate`
    park: ParkRecord
    # (address, bytes) of the packed cache's file as this process maps it, whose pages count in
    # weights_bytes whole but are shared with every engine of the same file (None: no such file)
    mapped_weights: tuple[int, int] | None = None


def activation_estimate(
    tokens: int,
    hidden: int,
    intermediate: int,
    qkv_width: int,
    sampled_rows: int,
    vocab: int,
    itemsize: int,
) -> int:
    """Bytes of one step's live activations over ``tokens`` tokens (CPU, where no allocator
    counts them): per token the residual stream, a norm's output and a block's output (3 x
    hidden), q/k/v and attention's output (``qkv_width`` + hidden), gate/up and their product (3 x
    intermediate); plus fp32 logits of the sampled rows. Attention's own scratch (a prefill's
    scores) and oneDNN's are not counted."""
    per_token = 4 * hidden + qkv_width + 3 * intermediate
    return tokens * per_token * itemsize + sampled_rows * vocab * 4
