"""scripts/bench_serving.py's parts: the seeded workload (``workload``), the per-request
results and their report (``results``), the streaming client and its closed and open loops
(``client``), the engine it may start (``engine_server``) and the in-process baselines on the
same prompts (``baselines``: the engine offline, transformers generate())."""
