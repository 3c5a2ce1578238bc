"""Modelyard engine: one process serving one model with a paged KV cache."""
