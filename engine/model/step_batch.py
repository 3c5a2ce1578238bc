"""What the runner is given to run: one step's tokens of every sequence, flattened into one row."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepBatch:
    """Host-side layout of one step (engine.core.scheduler.SchedulerOutput.to_step_batch builds it
    from the scheduled sequences)."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # flattened-batch rows whose logits are returned, in batch order
    # (source, destination) blocks to copy before the forward: copy-on-write of shared blocks
    copy_ops: list[tuple[int, int]] = field(default_factory=list)
