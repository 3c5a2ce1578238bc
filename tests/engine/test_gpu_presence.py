"""Triton stays out of engines on machines without a GPU (engine/gpu_presence.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from engine import gpu_presence
from engine.gpu_presence import GPU_DEVICE_NODES, decline_triton_without_gpu


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_presence.os.path, "exists", lambda path: False)


def test_declined_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    modules: dict = {}
    assert decline_triton_without_gpu({}, modules)
    assert modules == {"triton": None}


def test_kept_for_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    modules: dict = {}
    assert not decline_triton_without_gpu({"TRITON_INTERPRET": "1"}, modules)
    assert modules == {}


@pytest.mark.parametrize("node", GPU_DEVICE_NODES)
def test_kept_with_a_gpu(monkeypatch: pytest.MonkeyPatch, node: str) -> None:
    monkeypatch.setattr(gpu_presence.os.path, "exists", lambda path: path == node)
    modules: dict = {}
    assert not decline_triton_without_gpu({}, modules)
    assert modules == {}


def test_an_imported_triton_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    loaded = object()
    modules = {"triton": loaded}
    assert not decline_triton_without_gpu({}, modules)  # type: ignore[arg-type]
    assert modules["triton"] is loaded


@pytest.mark.skipif(
    any(os.path.exists(node) for node in GPU_DEVICE_NODES), reason="this machine has a GPU"
)
def test_transformers_models_import_without_triton() -> None:
    """What the engine imports (transformers' modeling modules, hence torch._dynamo) works with
    Triton declined, and Triton stays unloaded."""
    code = textwrap.dedent(
        """
        import os, sys
        from engine.gpu_presence import decline_triton_without_gpu
        assert decline_triton_without_gpu(os.environ)
        import transformers.models.gemma3.modeling_gemma3
        import torch._dynamo
        print(sys.modules["triton"])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
