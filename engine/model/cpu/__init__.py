"""What makes the engine fast on CPUs, gathered in one place; the runner enters through
`fast_path.prepare_cpu_fast_path`.

- `fast_path`: the entry point: thread count and prepacked linears at load, the per-forward thread
  policy, the lean forward.
- `linear`: prepacked (oneDNN, panel GEMM) and fused linears, `StepGemms` for the lean forward.
- `lean_forward`: decoder layers (llama, mistral, qwen2/3, gemma3, phi3: what each departs from
  the Llama block, as data, in `lean_layers`) as a fixed minimal op sequence over those linears;
  `fused_decode`: its decode-only steps on the C decode kernel (the "cpu" attention backend itself
  lives with the other backends, in `engine.model.attention.cpu_backend`).
- `threads`: per-op thread counts; `openmp_env`: how idle OpenMP threads wait (set before torch
  loads, by engine.__main__); `huge_pages`: huge-page memory for the panel GEMM's weights.
- `kernels/`: the C sources and their ctypes bindings.
"""
