"""Models from ``modelyard serve``'s command line: ``modelyard serve PATH`` (one model, served under
the file's stem, or a folder's name), or ``--model PATH [per-model flags] --model PATH2 ...``.

The flags make the document a models.yaml would hold, and the same reader reads it, so every rule
of the file applies (a problem names the flag); ``--print-config`` writes that document, a
models.yaml to start from. Sources are written as absolute paths: the file works from any folder.

Pairing: each per-model flag applies to the ``--model`` before it, once (``--alias`` may repeat);
one before the first ``--model``, or given twice for one model, is refused. With the positional
PATH (one model) the per-model flags apply to it wherever they stand, and ``--model`` is refused.
A fleet comes from a file (``-c``) or from the command line, never half of each.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.config import ADMIN_KEY_ENV, ConfigError, FleetConfig, GatewaySettings, parse_config

COMMAND_LINE = "command line"  # where the reader says a problem is


@dataclass(frozen=True)
class ModelFlag:
    flag: str
    key: str  # the models.yaml key it sets
    help: str
    type: Callable[[str], Any] = str
    metavar: str | None = None
    repeats: bool = False  # each use adds to a list


SOURCE = ModelFlag("--model", "source", "a model to serve (again for more), followed by its own "
                   "flags", metavar="PATH")  # fmt: skip
MODEL_FLAGS = (
    ModelFlag("--served-model-name", "name", "the name clients ask for (default: the file's "
              "stem, or the folder's name)", metavar="NAME"),
    ModelFlag("--alias", "aliases", "another name for it (again for more)", metavar="NAME",
              repeats=True),
    ModelFlag("--replicas", "replicas", "engine processes", int, "N"),
    ModelFlag("--residency", "residency", "pinned (default: runs from start to stop) or "
              "on_demand (starts at its first request, parked when idle)", metavar="KIND"),
    ModelFlag("--idle-ttl-s", "idle_ttl_s", "on_demand: idle seconds before it is parked", float,
              "S"),
    ModelFlag("--priority", "priority", "on_demand: lower goes first when memory is short", int,
              "N"),
    ModelFlag("--device", "device", "auto (default), cpu or cuda", metavar="DEVICE"),
    ModelFlag("--max-model-len", "max_model_len", "prompt + output tokens", int, "N"),
    ModelFlag("--max-num-seqs", "max_num_seqs", "sequences per step", int, "N"),
    ModelFlag("--kv-cache-memory", "kv_cache_memory", "CPU KV cache per replica, e.g. 512MiB",
              metavar="SIZE"),
    ModelFlag("--gpu-memory-fraction", "gpu_memory_fraction", "CUDA: per replica", float, "F"),
    ModelFlag("--memory-estimate", "memory_estimate", "one replica's memory until measured",
              metavar="SIZE"),
    ModelFlag("--engine-args", "engine_args", "more engine flags, one string: "
              '--engine-args="--num-threads 2"', shlex.split, "ARGS"),
)  # fmt: skip
_FLAG_OF = {f.key: f.flag for f in MODEL_FLAGS}
_MODEL_KEY = re.compile(r"models\[(\d+)\](?:\.(\w+))?")


class _ModelArgument(argparse.Action):
    """``--model PATH`` starts a model; a per-model flag sets its key on the model before it
    (before any ``--model``: on the positional PATH's, checked once parsed)."""

    def __init__(self, option_strings: list[str], dest: str, spec: ModelFlag, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.spec = spec

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        value: Any,
        option_string: str | None = None,
    ) -> None:
        if namespace.models is None:
            namespace.models = []
        entries: list[dict[str, Any]] = namespace.models
        key = self.spec.key
        if key == "source" or not entries:
            entries.append({})
        entry = entries[-1]
        if self.spec.repeats:
            entry.setdefault(key, []).append(value)
        elif key in entry:
            where = f"--model {entry['source']}" if "source" in entry else "PATH"
            parser.error(f"{option_string} given twice for {where}: each per-model flag applies "
                         "once, to the --model before it")  # fmt: skip
        else:
            entry[key] = value


def add_model_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="serve this one model (a GGUF file or a model folder), named after the file's stem",
    )
    group = serve.add_argument_group(
        "models from the command line (instead of -c)",
        "Each per-model flag applies to the --model before it; with PATH, to PATH.",
    )
    for spec in (SOURCE, *MODEL_FLAGS):
        group.add_argument(spec.flag, action=_ModelArgument, dest="models", spec=spec,
                           type=spec.type, metavar=spec.metavar, help=spec.help)  # fmt: skip
    group.add_argument(
        "--print-config",
        action="store_true",
        help="print these models as a models.yaml (to start one from) and exit",
    )


def command_line_fleet(
    args: argparse.Namespace, serve: argparse.ArgumentParser
) -> tuple[FleetConfig, dict[str, Any]] | None:
    """The fleet the command line gives, and its models.yaml document; None when it gives no
    model (the fleet is a file's). Ambiguous flags end in ``serve.error`` (exit status 2), a
    fleet that does not validate in ConfigError."""
    models = _command_line_models(args, serve)
    if models is None:
        return None
    document = _fleet_document(models, args.host, args.port)
    return _fleet_config(document, models), document


def _command_line_models(
    args: argparse.Namespace, serve: argparse.ArgumentParser
) -> list[dict[str, Any]] | None:
    """The models the command line gives, as models.yaml entries; None when it gives none (the
    fleet is a file's). Ambiguous input ends in ``serve.error`` (exit status 2)."""
    entries: list[dict[str, Any]] = args.models or []
    leading = entries[0] if entries and "source" not in entries[0] else None
    models = [e for e in entries if "source" in e]
    if args.path is not None:
        if models:
            serve.error("PATH serves one model; for several, give each with --model PATH")
        models = [{"source": args.path, **(leading or {})}]
    elif leading is not None:
        serve.error(f"{_flags(leading)} before any --model: each per-model flag applies to the "
                    "--model before it")  # fmt: skip
    if not models:
        return None
    if args.config is not None:
        serve.error("-c and PATH/--model: a fleet comes from a models.yaml or from the command "
                    "line (--print-config writes one to start a file from)")  # fmt: skip
    return models


def _flags(entry: dict[str, Any]) -> str:
    return ", ".join(_FLAG_OF[key] for key in entry)


def _fleet_document(
    models: list[dict[str, Any]], host: str | None, port: int | None
) -> dict[str, Any]:
    """The models.yaml document of a command line: its models (each named after its file when
    no name is given), the listen address (secure defaults: 127.0.0.1, open mode on loopback only)
    and the admin key's conventional variable."""
    d = GatewaySettings()
    host = host or d.host
    listen = f"[{host}]:{port or d.port}" if ":" in host else f"{host}:{port or d.port}"
    entries = []
    for model in models:
        source = os.path.abspath(model["source"])
        settings = {k: model[k] for k in _FLAG_OF if k in model and k not in ("name", "aliases")}
        entry = {"name": model.get("name") or _served_name(source)}
        if "aliases" in model:
            entry["aliases"] = model["aliases"]
        entries.append({**entry, "source": source, **settings})
    return {
        "gateway": {"listen": listen, "auth": {"admin_key_env": ADMIN_KEY_ENV}},
        "models": entries,
    }


def _served_name(source: str) -> str:
    path = Path(source)
    return path.name if path.is_dir() else path.stem


def _fleet_config(document: dict[str, Any], models: list[dict[str, Any]]) -> FleetConfig:
    """Reads the document as a models.yaml; a problem names the ``--model`` and flag it is about."""
    try:
        return parse_config(document, COMMAND_LINE, Path.cwd())
    except ConfigError as exc:
        raise ConfigError([_on_the_command_line(p, models) for p in exc.problems]) from None


def _on_the_command_line(problem: str, models: list[dict[str, Any]]) -> str:
    """``models[1].kv_cache_memory`` → ``--model PATH --kv-cache-memory`` (``source`` is the
    ``--model`` itself), ``gateway.listen`` → ``--host``."""

    def flag(match: re.Match[str]) -> str:
        model = f"--model {models[int(match[1])]['source']}"
        key = match[2]
        return model if key in (None, "source") else f"{model} {_FLAG_OF.get(key, key)}"

    return _MODEL_KEY.sub(flag, problem.replace(": gateway.listen:", ": --host:"))


def config_text(document: dict[str, Any]) -> str:
    """The document as a models.yaml, ``modelyard serve -c`` serves the same fleet from it."""
    header = "# From `modelyard serve --print-config`; every key: docs/OPERATIONS.md\n"
    return header + yaml.safe_dump(document, sort_keys=False)
