"""Check how the packages import one another: down the floors, through public modules only.

The packages stand on floors, lowest first:

1. tl-core;
2. the drivers that build on tl-core alone: hf and the template a new driver starts from;
3. vllm, which reads tl-core's descriptions and, for vLLM's Transformers backend only (an
   extra), the hf driver's reading of transformers' modules;
4. the packages that use drivers: inspect and parity.

A package's source may import its own modules and, from packages on lower floors that its
``pyproject.toml`` requires (as a dependency or in an extra), only public modules: no part of
the module's name after the package's may start with an underscore. Sideways and upward
imports, imports of a package it does not require, and imports of another package's private
modules are reported with the file and line. Every import counts, those inside functions and
under ``if TYPE_CHECKING:`` too: a type-only import of a private module breaks as surely when
that module moves. tl-core's own subpackage floors are tl-core's ``tests/test_layout.py``.

Within a package no modules may import one another in a circle, type-only imports counted
(a circle makes the import order matter and ties the modules into one unit): each circle is
reported with its modules and the import line of each step.

Usage: ``python scripts/check_layout.py`` (exit 1 when something is reported); ``nox -s lint``
runs it.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
#: Lowest first, by distribution name.
FLOORS: list[set[str]] = [
    {"tl-core"},
    {"tl-driver-hf", "tl-driver-template"},
    {"tl-driver-vllm"},
    {"tl-driver-inspect", "tl-parity"},
]


@dataclass(frozen=True)
class Package:
    """One distribution of the repository: its name, import name, source folder and requirements."""

    name: str
    module: str
    source: Path
    requires: frozenset[str]

    @property
    def floor(self) -> int:
        return next(i for i, names in enumerate(FLOORS) if self.name in names)


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def packages(root: Path = ROOT) -> list[Package]:
    """The repository's packages (every ``packages/*/pyproject.toml`` with a ``src`` folder)."""
    found = []
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        modules = [p for p in (pyproject.parent / "src").iterdir() if (p / "__init__.py").exists()]
        if len(modules) != 1:
            raise SystemExit(
                f"{pyproject.parent}: expected one package under src/, found {[m.name for m in modules]}"
            )
        found.append(
            Package(
                project["name"],
                modules[0].name,
                modules[0],
                frozenset(map(_requirement_name, requirements)),
            )
        )
    return found


def _imports(tree: ast.AST) -> list[tuple[str, int]]:
    """Every absolute module an AST imports, with its line (``from a import b`` also names ``a.b``:
    ``b`` may be a module)."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            found += [
                (f"{node.module}.{a.name}", node.lineno)
                for a in node.names
                if a.name.startswith("_")
            ]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
    return sorted(found, key=lambda item: item[1])


def _module_name(package: Package, path: Path) -> str:
    parts = list(path.relative_to(package.source.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _internal_imports(package: Package) -> dict[str, dict[str, tuple[Path, int]]]:
    """Each module of ``package`` -> the package's modules it imports, with file and line.

    ``from p import m`` where ``p.m`` is a module counts as importing ``p.m`` (not ``p``);
    relative imports are resolved.
    """
    paths = {_module_name(package, path): path for path in package.source.rglob("*.py")}
    graph: dict[str, dict[str, tuple[Path, int]]] = {name: {} for name in paths}
    for name, path in paths.items():
        home = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = home[: len(home) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                targets = [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module
                    for a in node.names
                ]
            for target in targets:
                if target in paths and target != name:
                    graph[name].setdefault(target, (path, node.lineno))
    return graph


def import_circles(package: Package) -> list[list[str]]:
    """The circles of imports inside ``package``: each as a closed path of module names."""
    graph = _internal_imports(package)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    circles = []
    for component in components:
        # One closed path through the component, from its first module.
        inside, path = set(component), [component[0]]
        while True:
            nxt = next(t for t in sorted(graph[path[-1]]) if t in inside)
            if nxt in path:
                circles.append([*path[path.index(nxt) :], nxt])
                break
            path.append(nxt)
    return circles


def _circle_problems(package: Package, root: Path) -> list[str]:
    graph = _internal_imports(package)
    found = []
    for circle in import_circles(package):
        steps = [
            f"{a} -> {b} ({graph[a][b][0].relative_to(root)}:{graph[a][b][1]})"
            for a, b in itertools.pairwise(circle)
        ]
        found.append(
            f"{package.name}: modules import one another in a circle: {'; '.join(steps)} "
            "(move what both need into a module of its own, or depend on a Protocol)"
        )
    return found


def problems(root: Path = ROOT) -> list[str]:
    """What breaks the layout, one line each (empty when it holds)."""
    every = packages(root)
    unplaced = [p.name for p in every if not any(p.name in names for names in FLOORS)]
    if unplaced:
        return [f"packages on no floor (add them to FLOORS in scripts/check_layout.py): {unplaced}"]
    by_module = {p.module: p for p in every}
    found: list[str] = []
    for package in every:
        for path in sorted(package.source.rglob("*.py")):
            where = path.relative_to(root)
            for module, line in _imports(ast.parse(path.read_text(), str(path))):
                target = by_module.get(module.split(".")[0])
                if target is None or target is package:
                    continue
                if target.floor >= package.floor:
                    side = "sideways" if target.floor == package.floor else "upward"
                    found.append(
                        f"{where}:{line}: {package.name} imports {module} ({side}: {target.name} is on "
                        f"floor {target.floor + 1}, {package.name} on floor {package.floor + 1})"
                    )
                elif target.name not in package.requires:
                    found.append(
                        f"{where}:{line}: {package.name} imports {module}, but its pyproject.toml does not "
                        f"require {target.name} (add it to the dependencies or to an extra)"
                    )
                private = [
                    part
                    for part in module.split(".")[1:]
                    if part.startswith("_") and not part.startswith("__")
                ]
                if private:
                    found.append(
                        f"{where}:{line}: {package.name} imports {module}, a private module of "
                        f"{target.name} ({'.'.join(private)}); import it from a public module, or make "
                        f"{target.name} export it"
                    )
        found += _circle_problems(package, root)
    return found


def main() -> int:
    """Print what breaks the layout; return the exit code."""
    found = problems()
    if found:
        print("the packages' layout is broken:", *found, sep="\n", file=sys.stderr)
        return 1
    print(
        f"layout holds: {len(packages())} packages on {len(FLOORS)} floors, public imports only, "
        "no import circles"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
