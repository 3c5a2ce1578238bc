"""scripts/bench_engine.py's sections, one module each (``limit``, ``hf``, ``mixed``, ``prefix``,
``memory``: ``bench_<name>(args)`` returns the section's JSON), on ``shared``'s engine set-up and
prompts. Importing them loads torch: bench_engine.py sets the OpenMP wait policy first."""
