"""The packages' import rules: common/ imports neither tower, gateway/ imports nothing from
engine/ (its engines are processes, reached over HTTP and a command line), no package's modules
import each other in a cycle, and no folders do either."""

from __future__ import annotations

import ast
from collections.abc import Collection
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "gateway", "engine")


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Every module of ``packages`` under ``root`` -> the other modules of theirs it imports."""
    paths = {
        _module_name(root, path): path
        for package in packages
        for path in (root / package).rglob("*.py")
    }
    return {name: _imports(path, paths.keys()) - {name} for name, path in paths.items()}


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: Collection[str]) -> set[str]:
    """The ``modules`` that ``path`` imports, at any depth (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import mod`` imports pkg.mod; ``from pkg.mod import name``, pkg.mod.
            found.update(
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in modules
                else node.module
                for alias in node.names
            )
    return {name for name in found if name in modules}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first search of ``graph`` meets, each as the path that closes it."""
    state: dict[str, str] = {}
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def folder_loops(graph: dict[str, set[str]]) -> list[str]:
    """Loops between folders, which no module-level cycle shows: at every package, its
    subpackages are the nodes, each standing for everything below it, with an edge A -> B where
    a module under A imports one under B; each loop is named with one such import per edge.

    A package's own modules and its subpackages are not compared: edges between them run both
    ways by design (engine/__main__.py starts serving/, whose modules read engine/config.py; a
    runner composes the folders beside it, which share the modules beside it), and a loop
    through those modules is a module-level cycle."""
    packages = _packages(graph)
    edges: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], str] = {}
    for module in sorted(graph):
        for imported in sorted(graph[module]):
            source, target = _folder(module, packages), _folder(imported, packages)
            shared = 0  # the depth of the package holding both
            while shared < min(len(source), len(target)) and source[shared] == target[shared]:
                shared += 1
            if shared < len(source) and shared < len(target):  # under two sibling subpackages
                edge = (".".join(source[: shared + 1]), ".".join(target[: shared + 1]))
                edges.setdefault(edge[0], set()).add(edge[1])
                witness.setdefault(edge, f"{module} imports {imported}")
    return [
        " -> ".join(loop) + ": " + "; ".join(witness[edge] for edge in pairwise(loop))
        for loop in cycles(edges)
    ]


def _packages(graph: dict[str, set[str]]) -> set[str]:
    """The modules of ``graph`` that are packages (folders): those with modules beneath."""
    return {name.rpartition(".")[0] for name in graph}


def _folder(module: str, packages: set[str]) -> list[str]:
    """The folder a module's file is in, as its path of package names."""
    return (module if module in packages else module.rpartition(".")[0]).split(".")


GRAPH = import_graph(ROOT, PACKAGES)


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
    """Module-level cycles; a cycle makes import order matter."""
    assert not cycles(GRAPH), cycles(GRAPH)


def test_no_folder_level_loops():
    assert not folder_loops(GRAPH), folder_loops(GRAPH)


def test_a_folder_level_loop_fails_the_rule(tmp_path: Path):
    """Two folders importing each other's modules (one from a subfolder) with no module-level
    cycle: the folder rule reports the loop; a package and its own subfolder importing each
    other (top.py composes deep/, deep/ reads base.py) is not one."""
    files = {
        "app/a/deep/one.py": "import app.b.two\n",
        "app/a/three.py": "",
        "app/a/top.py": "from app.a.deep import one\n",
        "app/a/base.py": "",
        "app/a/deep/four.py": "from app.a.base import VALUE\n",
        "app/b/two.py": "from app.a import three\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("app",))
    assert graph["app.b.two"] == {"app.a.three"}
    assert not cycles(graph)
    assert folder_loops(graph) == [
        "app.a -> app.b -> app.a: app.a.deep.one imports app.b.two; app.b.two imports app.a.three"
    ]


# engine/'s layers, each allowed to import itself and what is listed (its own package and below):
# serving -> core -> model, and core -> structured (grammars and matchers, beside model); the base
# modules (config, errors, file_hash) import no engine module.
ENGINE_BASE = frozenset({"engine.config", "engine.errors", "engine.file_hash", "engine.startup"})
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


def test_core_enters_model_through_its_top_modules():
    """core/ imports model/'s own modules (runner, loader, sampling_ops, ...), never the folders
    beneath it (attention/, cpu/, park/), whose layout stays model/'s business."""
    packages = _packages(GRAPH)
    offenders = sorted(
        f"{module} imports {imported}"
        for module, imports in GRAPH.items()
        if _engine_layer(module) == "engine.core"
        for imported in imports
        if _engine_layer(imported) == "engine.model"
        and _folder(imported, packages) != ["engine", "model"]
    )
    assert not offenders, offenders


def test_scripts_never_import_tests():
    """What a benchmark and a test share lives under scripts/ (the fuzzer, the tiny models, the
    mock upstream): tests import scripts, never the other way round."""
    graph = import_graph(ROOT, ("scripts", "tests"))
    offenders = sorted(
        f"{module} imports {imported}"
        for module, imports in graph.items()
        if module.split(".")[0] == "scripts"
        for imported in imports
        if imported.split(".")[0] == "tests"
    )
    assert not offenders, offenders
