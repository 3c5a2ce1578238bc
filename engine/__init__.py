"""Modelyard engine: one process serving one model with a paged KV cache."""


def __getattr__(name: str) -> object:
    """``engine.LLM`` and ``engine.SamplingParams``, imported lazily (torch is heavy)."""
    if name == "LLM":
        from engine.core.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
