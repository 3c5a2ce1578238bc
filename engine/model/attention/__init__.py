"""Paged attention: every layer writes its new K/V into the block pools, then attends over each
sequence's blocks, through the backend chosen at load.

- `metadata`: the step's batch layout (slots, block tables, lengths) that every layer reads.
- `backends`: the backend choice (`select_backend`) and `paged_attention`, the one entry point.
- `torch_reference`: the torch implementation, the reference every other backend is tested against.
- `triton_kernels`: the CUDA backend. The "cpu" backend lives with the other CPU speed-ups, in
  `engine.model.cpu.attention`.
"""
