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

Usage: ``python scripts/check_layout.py`` (exit 1 when something is reported); ``nox -s lint``
runs it.
"""

from __future__ import annotations

import ast
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
    return found


def main() -> int:
    """Print what breaks the layout; return the exit code."""
    found = problems()
    if found:
        print("the packages' layout is broken:", *found, sep="\n", file=sys.stderr)
        return 1
    print(f"layout holds: {len(packages())} packages on {len(FLOORS)} floors, public imports only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
