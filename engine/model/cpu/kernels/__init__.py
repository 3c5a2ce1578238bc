"""The CPU path's C kernels and their ctypes bindings; without a C compiler every caller runs torch.

- `build`: compiles the sources beside this file on first use (cached per CPU and compiler) and
  loads the library; `available()` says whether it could.
- `paged_decode`: decode attention straight over the paged K/V pools (optionally fused with the
  step's rotary and cache write), the K/V slot write, and the bare K/V read the benchmark times.
- `panel_gemm`: fp32 linear layers of decode-sized batches.
- `fused_ops`: the lean forward's elementwise glue (residual add + RMSNorm, rotary, SiLU·up).
- `argmax`: the sampler's greedy argmax.
"""
