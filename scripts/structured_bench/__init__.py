"""scripts/bench_structured.py's parts: the workload and validity checks, the library
comparison, and the load generator that keeps each output's text."""
