"""Triton stays out of an engine on a machine without a GPU. transformers' modeling modules import
torch._dynamo, which imports Triton whenever it is installed: tens of MB of resident memory in
every engine (and its template) and start-up time (docs/PERFORMANCE.md#model-loading), for
kernels that cannot run without a GPU. The tests' CPU interpreter (``TRITON_INTERPRET``) keeps
it."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from types import ModuleType

# NVIDIA's driver and AMD's ROCm create these; without either no Triton kernel can launch.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


def decline_triton_without_gpu(
    environ: Mapping[str, str], modules: MutableMapping[str, ModuleType | None] = sys.modules
) -> bool:
    """Makes ``import triton`` fail (as if it were not installed, which torch handles) unless
    the machine has a GPU or Triton's interpreter is asked for; True when declined. Call before
    anything imports torch._dynamo."""
    if environ.get("TRITON_INTERPRET") or any(os.path.exists(n) for n in GPU_DEVICE_NODES):
        return False
    if "triton" in modules:  # imported already: too late to save anything
        return False
    modules["triton"] = None  # a None entry: the import raises ModuleNotFoundError
    return True
