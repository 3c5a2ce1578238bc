"""Paged attention: every layer writes its new K/V into the block pools, then attends over each
sequence's blocks, through the backend chosen at load.

- `metadata`: the step's batch layout (slots, block tables, lengths) that every layer reads.
- `backends`: the backend choice (`select_backend`) and `paged_attention`, the one entry point.
- `torch_reference`: the torch implementation, the reference every other backend is tested against.
- `cpu_backend`: the C pieces of the "cpu" backend (cache write, decode groups), over the kernels
  of `engine.model.cpu.kernels`.
- `triton_kernels`: the CUDA backend.
"""
