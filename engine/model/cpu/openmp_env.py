"""How idle OpenMP workers wait, set for ``python -m engine`` before torch (and so libgomp) loads:
libgomp reads these variables once, when it loads.

Default: they sleep at once (``OMP_WAIT_POLICY=PASSIVE``). Engines share the machine's cores
(several replicas, the gateway), and spinning workers made a contended decode step many times
slower. The price is a wake-up at every parallel region (each GEMM; a layer's decode attention
shares its qkv projection's), some 120 times per decode step on fp32 weights; on narrow ones a
step's layers and its lm_head run in one region (engine.model.cpu.kernels.narrow_decode).

``--spin-wait`` (the gateway passes it when it runs a single engine): workers spin for
``GOMP_SPINCOUNT`` = 10000 turns (~0.1 ms by libgomp's estimate of 100k per ms) before they sleep,
which catches the next region of a step: faster for an engine alone on its cores, slower for
engines that share them. Figures for both policies: docs/PERFORMANCE.md#openmp-wait-policy.
Whatever the environment already sets for either variable wins.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

from common.engine_args import SPIN_WAIT_FLAG

_SPIN_COUNT = "10000"


def configure(argv: Sequence[str], environ: MutableMapping[str, str]) -> None:
    """Set the wait policy in ``environ`` for an engine started with ``argv``."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return  # the operator's choice
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if SPIN_WAIT_FLAG in argv:
        # an explicit count: libgomp spins that long despite PASSIVE
        environ["GOMP_SPINCOUNT"] = _SPIN_COUNT
