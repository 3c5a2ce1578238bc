"""models.yaml as a whole: the file read and parsed, its sections read, and the rules that span
sections (served names unique, API keys' models known, the GPU's memory not overcommitted)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from gateway.config.defaults import read_defaults
from gateway.config.gateway_settings import read_gateway
from gateway.config.models import read_model
from gateway.config.reader import ConfigError, Reader
from gateway.config.schema import FleetConfig, ModelConfig


def load_config(path: str | os.PathLike[str]) -> FleetConfig:
    """Reads and validates a models.yaml file; raises ConfigError listing every problem."""
    file = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError([f"{file}: cannot read: {exc.strerror or exc}"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{file}: {where}invalid YAML: {problem}"]) from exc
    return parse_config(data, file, Path(path).resolve().parent)


def parse_config(data: Any, file: str = "models.yaml", base_dir: Path | None = None) -> FleetConfig:
    """Validates a parsed YAML document; raises ConfigError listing every problem."""
    problems: list[str] = []
    root = Reader(data, "", problems, file)
    base_dir = base_dir or Path.cwd()
    gateway = read_gateway(root.section("gateway"), base_dir)
    defaults = read_defaults(root.section("defaults"))
    raw_models = root.raw("models")
    models: list[ModelConfig] = []
    if not isinstance(raw_models, list) or not raw_models:
        root.error("models", "must be a non-empty list of models")
        raw_models = []
    served: dict[str, str] = {}  # name or alias → the models[i] that serves it
    for i, item in enumerate(raw_models):
        entry = root.item("models", i, item)
        model = read_model(entry, defaults, gateway, base_dir)
        if model is None:
            continue
        for served_name in (model.name, *model.aliases):
            if served_name in served:
                entry.error(
                    None, f"name or alias {served_name!r} is already used by {served[served_name]}"
                )
            served[served_name] = entry.path
        models.append(model)
    for i, key in enumerate(gateway.auth.keys):
        for allowed in key.models or ():
            if allowed not in served:
                problems.append(f"{file}: gateway.auth.keys[{i}].models: unknown model {allowed!r}")
    local = [m for m in models if m.local]
    if len(local) == 1 and local[0].replicas == 1:  # the only engine (ModelConfig.spin_wait)
        models = [replace(m, spin_wait=True) if m is local[0] else m for m in models]
    # Pinned engines are all awake at once; on-demand ones only as the budget allows, so each
    # must fit on its own.
    budget = gateway.memory.gpu_fraction
    gpu_sum = sum(m.gpu_share * m.replicas for m in models if not m.on_demand)
    if gpu_sum > budget:
        root.error(
            "models",
            f"gpu_memory_fraction x replicas of the pinned models sums to {gpu_sum:.2f} on the "
            f"GPU; it must be <= {budget}",
        )
    for model in models:
        if model.on_demand and model.gpu_share * model.replicas > budget:
            root.error("models", f"{model.name}: gpu_memory_fraction x replicas exceeds {budget}")
    root.finish()
    if problems:
        raise ConfigError(problems)
    return FleetConfig(path=file, gateway=gateway, models=tuple(models))
