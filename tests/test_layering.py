"""The packages' import rules: common/ imports neither tower, gateway/ imports nothing from
engine/ (its engines are processes, reached over HTTP and a command line), and no package's
modules import each other in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "gateway", "engine")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Project modules ``path`` imports, at any depth (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import mod`` imports pkg.mod; ``from pkg.mod import name``, pkg.mod.
            found.update(
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in MODULES
                else node.module
                for alias in node.names
            )
    return {name for name in found if name.split(".")[0] in PACKAGES}


MODULES = {
    _module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
}


def _graph() -> dict[str, set[str]]:
    return {
        name: {imported for imported in _imports(path) if imported in MODULES and imported != name}
        for name, path in MODULES.items()
    }


GRAPH = _graph()


@pytest.mark.parametrize(
    ("importer", "forbidden"), [("common", ("gateway", "engine")), ("gateway", ("engine",))]
)
def test_layers_import_only_downwards(importer, forbidden):
    offenders = sorted(
        f"{module} imports {imported}"
        for module, imports in GRAPH.items()
        if module.split(".")[0] == importer
        for imported in imports
        if imported.split(".")[0] in forbidden
    )
    assert not offenders, offenders


def test_no_import_cycles():
    """Module-level cycles, found by depth-first search; a cycle makes import order matter."""
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(GRAPH[module]):
            if state.get(imported) == "open":
                cycles.append([*path[path.index(imported) :], imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


# engine/'s layers, each allowed to import itself and what is listed (its own package and below):
# serving -> core -> model, and core -> structured (grammars and matchers, beside model); the base
# modules (config, errors, file_hash) import no engine module.
ENGINE_BASE = frozenset({"engine.config", "engine.errors", "engine.file_hash"})
ENGINE_LAYERS = {
    "engine.model": (),
    "engine.structured": (),
    "engine.core": ("engine.model", "engine.structured"),
    "engine.serving": ("engine.core",),
}


def _engine_layer(module: str) -> str | None:
    return next((layer for layer in ENGINE_LAYERS if f"{module}.".startswith(f"{layer}.")), None)


def test_engine_layers_import_only_downwards():
    offenders = []
    for module, imports in GRAPH.items():
        if module in ENGINE_BASE:
            allowed: tuple[str, ...] = ()
        elif (layer := _engine_layer(module)) is not None:
            allowed = (layer, *ENGINE_LAYERS[layer])
        else:
            continue  # engine/__init__.py and __main__.py are entry points; other packages
        offenders += [
            f"{module} imports {imported}"
            for imported in imports
            if imported.startswith("engine")
            and imported not in ENGINE_BASE | {"engine"}
            and _engine_layer(imported) not in allowed
        ]
    assert not offenders, sorted(offenders)
