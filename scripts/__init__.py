"""Benchmarks, the fuzzer and their tools. Each entry point is a script run from the checkout
(``python scripts/NAME.py``) and its parts are the package beside it: bench_attacks.py →
``attacks/``, bench_density.py → ``density_bench/``, bench_engine.py → ``engine_bench/``,
bench_peers.py → ``peers/``,
bench_residency.py → ``residency_bench/``, bench_serving.py → ``serving/``, bench_structured.py →
``structured_bench/``, fuzz.py → ``fuzzer/``. What a script shares with the tests lives here too:
``fuzzer/`` (tests/test_fuzz.py runs a short fuzz), ``mock_upstream.py`` (an OpenAI-compatible
mock server and the handle that starts one), ``tiny_models.py`` (tiny random models) and
``measure.py``. So imports go one way: tests/ import scripts/, scripts/ never import tests/.
Process helpers (/proc readings, stopping a child) come from common/processes.py, which the
engine uses too."""
