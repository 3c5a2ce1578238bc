"""The engine's step loop and what it reasons about, independent of how the model runs.

Sequences and their KV blocks (`sequence`, `blocks` over `block_pool`), continuous batching
(`scheduler`), token choice (`sampling`, `sampling_params`), text (`detokenizer`), and the loop
that ties them to the model runner (`engine_core`), plus the offline `LLM` API (`llm`). Imports
engine.model's top-level modules (the runner, the loader, the sampler's `sampling_ops`), never
engine.serving.
"""
