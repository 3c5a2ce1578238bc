"""scripts/bench_residency.py's parts: the seeded request stream (``stream``), the figures a run
reports (``summary``: percentiles, metric deltas, the memory budget, the ratios), the streaming
client that replays the stream (``client``), one gateway process and its admin and metrics
endpoints (``gateway``), and the three policies and the per-model timings (``policies``).
``stream`` and ``summary`` are pure (tests/test_bench_residency.py)."""
