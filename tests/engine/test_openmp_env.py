"""The OpenMP wait policy python -m engine sets before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.model.cpu.openmp_env import configure


def test_threads_sleep_unless_the_engine_is_told_to_spin() -> None:
    environ: dict[str, str] = {}
    configure(["--model", "m"], environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    environ = {}
    configure(["--model", "m", "--spin-wait"], environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def test_the_operators_settings_win() -> None:
    for given in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}):
        environ = dict(given)
        configure(["--spin-wait"], environ)
        assert environ == given


def test_python_m_engine_applies_it_before_torch_loads() -> None:
    """The real entry point: --help exits before serving, after the environment is set."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    probe = (
        "import os, runpy, sys; sys.argv = ['engine', '--spin-wait', '--help'];\n"
        "try:\n    runpy.run_module('engine', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip().splitlines()[-1] == "10000 False"
    assert "--spin-wait" in out.stdout
