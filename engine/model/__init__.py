"""Running the model: loading it (`loader`), sizing the KV cache (`kv_cache`), and executing one
flattened step (`runner`) with our paged attention inside transformers' forward
(`transformers_attention`, `step_context`, `attention/`). CPU-only speed-ups live in `cpu/`, which
the runner reaches through `cpu.fast_path`.

Imports nothing from engine.core or engine.serving: the runner is handed a `StepBatch` of token
ids, positions and block tables, and never sees a sequence.
"""
