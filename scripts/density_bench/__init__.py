"""scripts/bench_density.py's parts: how many copies fit (``fill``: pure counting, fed by either
side), the request round across the copies awake (``round``), and the two sides: Modelyard's
gateway with N copies of one GGUF under a memory budget (``modelyard``) and llama-server
processes on the same file summed to the same budget (``llama``)."""
