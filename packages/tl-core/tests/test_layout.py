"""tl-core's layout: subpackages on floors, each importing only from floors below, no circles.

The floors are the architecture a newcomer reads: the bundled-model locator, hook names, then
the engine-independent model descriptions, then specs, then the figures (plain arrays in, matplotlib figures out), then the cache,
then certification's checks and reports, GGUF checkpoints, then sparse dictionaries' tensors and their work in one forward pass, then the driver-author API, then sparse dictionaries
as researchers load, splice and evaluate them, then the bridges over drivers, then the built-in native driver, the
activation store built on any bridge, and the command line. Imports are read from the source (``ast``), including those inside
functions; imports under ``if TYPE_CHECKING:`` are annotations only and are skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tl_core
from tl_core._lazy import is_type_checking

ROOT = Path(tl_core.__file__).parent
#: Lowest first. A module may import from its own floor and the floors below it.
FLOORS = [
    "_version",
    "_lazy",
    "_errors",
    "models",
    "hooks",
    "architecture",
    "specs",
    "plots",
    "cache",
    "certification",
    "gguf",
    "_dictionaries",
    "driver_api",
    "sae",
    "bridges",
    "native",
    "analysis",
    "capture",
    "cli",
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("tl_core", *parts))


def _floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return len(FLOORS)  # the package root re-exports everything, lazily
    return FLOORS.index(parts[1])


def _runtime_imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tl_core"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("tl_core"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        graph[_module_name(path)] = _runtime_imports(ast.parse(path.read_text(), str(path)))
    return graph


def test_every_module_sits_on_a_known_floor() -> None:
    unplaced = [m for m in _graph() if "." in m and m.split(".")[1] not in FLOORS]
    assert not unplaced, f"modules on no floor (add their subpackage to FLOORS): {unplaced}"


def test_imports_only_reach_down() -> None:
    wrong = [
        f"{module} (floor {FLOORS[_floor(module)]}) imports {target}"
        for module, targets in _graph().items()
        if module != "tl_core"
        for target in targets
        if target != "tl_core" and _floor(target) > _floor(module)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_circles() -> None:
    graph = _graph()
    # Importing a package runs its __init__, so an edge to a module is also one to its package.
    edges = {
        module: {t for target in targets for t in (target, target.rpartition(".")[0]) if t in graph}
        for module, targets in graph.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in edges[node]:
            if target == node or target == "tl_core":
                continue
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module)


def test_researcher_and_driver_author_apis_are_separate() -> None:
    import tl_core.driver_api as driver_api

    researcher = set(tl_core.__all__)
    for name in ("LocalDriver", "DriverEntry", "build_plan", "ForwardResult", "validate_driver"):
        assert name in driver_api.__all__ and name not in researcher, name
    for name in (
        "TransformerBridge",
        "RemoteBridge",
        "ActivationCache",
        "InterventionSpec",
        "boot",
    ):
        assert name in researcher, name
    # Every export resolves (the lazy tables name real modules and attributes).
    for package in (tl_core, driver_api):
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)


def test_lazy_exports_are_the_type_checking_imports() -> None:
    """Each package declares an export once, as its ``if TYPE_CHECKING:`` import; the lazy
    table is read from it, so the two cannot drift apart."""
    import importlib

    from tl_core._errors import __all__ as errors
    from tl_core._lazy import declared_exports

    packages = sorted({_module_name(p) for p in ROOT.rglob("__init__.py")})
    for name in packages:
        package = importlib.import_module(name)
        table = declared_exports(Path(package.__file__).read_text())
        if not table:
            continue
        assert set(table) <= set(package.__all__), name
        for export, module in table.items():  # the value is the declared module's own object
            assert getattr(package, export) is getattr(importlib.import_module(module), export), (
                name,
                export,
            )
    assert set(errors) <= set(tl_core.__all__), "every error class is exported from tl_core"


def test_a_relative_lazy_export_is_refused() -> None:
    from tl_core._lazy import declared_exports

    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._x import A as A\n"
    with pytest.raises(ImportError, match="absolute import, got line 3"):
        declared_exports(source)
    assert declared_exports(
        "import typing\nif typing.TYPE_CHECKING:\n    from a.b import C as C, d\n"
    ) == {"C": "a.b", "d": "a.b"}
