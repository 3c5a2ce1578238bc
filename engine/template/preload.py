"""What an engine template imports before it forks engines: the one import list, and the check
that the process is still single-threaded (fork copies only the calling thread: a lock another
thread held, an OpenMP team, stays broken in the child).

The list is the engine's own import path (its CLI, server, core, loader, CPU fast path, grammar
compiler), the libraries it pulls in, and the modules transformers imports lazily once it knows
the model: configuration and tokenizers of the architectures most GGUFs carry. Not their modeling
modules (and so not torch._dynamo, which those import: ~190 MiB): an engine whose model its
snapshot rebuilds runs none of them (engine.model.skeleton), and a file's first start imports
them itself. Only
imports: nothing here may run an OpenMP parallel region, start a thread or set torch's thread
count (an engine sets its own, after the fork).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

OPENBLAS_THREADS = "OPENBLAS_NUM_THREADS"
# The engine's entry points; each imports the modules beneath it.
ENGINE_MODULES = (
    "engine.serving.cli",
    "engine.serving.server",
    "engine.serving.app",
    "engine.serving.status",
    "engine.core.engine_core",
    "engine.model.loader",
    "engine.model.runner",
    "engine.model.cpu.fast_path",
    "engine.model.cpu.narrow_weights",
    "engine.model.cpu.lean_forward",
    "engine.model.cpu.gguf_weights",
    "engine.model.park",
    "engine.structured.compiler",
    "engine.structured.workers",
)
LIBRARIES = (
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "gguf",
    "safetensors",
    "llguidance",
    "jinja2",
    "jsonschema",
    "aiohttp",
    "uvloop",
    "prometheus_client",
)
# transformers.models.<name>: configuration_ and, where the family has its own, tokenization_
# modules (the others use a sibling's: gemma3 gemma's, qwen3 qwen2's ...).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3")
TOKENIZER_FAMILIES = ("llama", "gpt2", "qwen2", "qwen3_5", "gemma", "t5")
# what transformers reads a GGUF's tokenizer and config with
TRANSFORMERS_GGUF = (
    "transformers.integrations.ggml",
    "transformers.integrations.gguf.gguf_tokenizer_mapping",
    "transformers.modeling_gguf_pytorch_utils",
)
# transformers' lazy top-level names the loader reaches (each imports its module)
TRANSFORMERS_NAMES = (
    "AutoConfig",
    "AutoTokenizer",
    "AutoModelForCausalLM",
    "GenerationConfig",
    "PreTrainedTokenizerFast",
)


def modules() -> list[str]:
    """Every module to import, in order (libraries first: the engine's modules need them)."""
    architectures = [f"transformers.models.{name}.configuration_{name}" for name in ARCHITECTURES]
    tokenizers = [f"transformers.models.{name}.tokenization_{name}" for name in TOKENIZER_FAMILIES]
    return [*LIBRARIES, "transformers.models.auto.tokenization_auto", *TRANSFORMERS_GGUF,
            *architectures, *tokenizers, *ENGINE_MODULES]  # fmt: skip


@dataclass
class Preloaded:
    """What preloading did: its seconds, and the modules that would not import (a library
    version without that architecture): an engine that needs one imports it itself."""

    seconds: float = 0.0
    missing: list[str] = field(default_factory=list)
    module_count: int = 0


def preload() -> Preloaded:
    """Imports the list, touches transformers' lazy names, then freezes what was imported out of
    the garbage collector's reach (a collection in a child would write to every object's header,
    copying the shared pages). Exits when a thread started meanwhile: forking is unsafe then."""
    began = time.monotonic()
    result = Preloaded()
    with _no_blas_threads():
        for name in modules():
            try:
                importlib.import_module(name)
            except ImportError:
                result.missing.append(name)
    transformers = sys.modules.get("transformers")
    for name in TRANSFORMERS_NAMES if transformers is not None else ():
        try:
            getattr(transformers, name)
        except (ImportError, AttributeError):
            result.missing.append(f"transformers.{name}")
    problem = thread_problem()
    if problem:
        sys.exit(f"engine template: {problem} after the imports; cannot fork engines")
    gc.collect()
    gc.freeze()
    result.seconds = time.monotonic() - began
    result.module_count = len(sys.modules)
    return result


@contextlib.contextmanager
def _no_blas_threads() -> Iterator[None]:
    """numpy's OpenBLAS starts a thread per core when it loads: one here, unless the operator
    set a count. The engine does no BLAS through numpy (torch has its own), and the variable goes
    again afterwards, so that what engines start (compile workers) gets the usual default."""
    if OPENBLAS_THREADS in os.environ:
        yield
        return
    os.environ[OPENBLAS_THREADS] = "1"
    try:
        yield
    finally:
        del os.environ[OPENBLAS_THREADS]


def thread_problem() -> str | None:
    """None while this process runs one thread; else which threads run (Python's and the
    others: an OpenMP team, a Rust pool)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        tasks = ["?"]  # no procfs: Python's own count must do
    if threading.active_count() == 1 and len(tasks) == 1:
        return None
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            names.append(task)
    return f"{len(tasks)} threads run ({', '.join(sorted(names))})"
