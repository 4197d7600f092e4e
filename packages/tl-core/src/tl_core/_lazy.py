"""Lazy package exports: a name is imported from its module on first access.

tl's packages are imported on cheap paths (the ``tl_core.drivers`` entry-point scan, the
``tl`` command) that must not pay for torch. A package declares each export once, as the
``if TYPE_CHECKING:`` import type checkers and editors read
(``from tl_core.cache._cache import ActivationCache as ActivationCache``); ``attach`` reads
those imports from the package's source, imports the module that holds a name when the name
is first used, and caches the value in the package namespace.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["attach", "declared_exports", "is_type_checking"]


def is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` test is ``TYPE_CHECKING`` (or ``typing.TYPE_CHECKING``)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def declared_exports(source: str) -> dict[str, str]:
    """Exported name -> absolute module, from the ``from X import a as a`` imports under a
    module's top-level ``if TYPE_CHECKING:``.

    Raises:
        ImportError: A relative import there (its module would be ambiguous here).
    """
    table: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.If) and is_type_checking(node.test)):
            continue
        for statement in ast.walk(node):
            if isinstance(statement, ast.ImportFrom):
                if statement.level or not statement.module:
                    raise ImportError(
                        f"a lazy export needs an absolute import, got line {statement.lineno}"
                    )
                table.update(
                    {alias.asname or alias.name: statement.module for alias in statement.names}
                )
    return table


def attach(package: str) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of a package with lazy exports: the
    names its ``if TYPE_CHECKING:`` block imports.

    Args:
        package: The package's ``__name__`` (the package is being imported, so its source is
            known).

    Returns:
        ``(__getattr__, __dir__, __all__)`` to assign at the package's top level.
    """
    source = sys.modules[package].__file__
    if source is None:
        raise ImportError(f"{package} has no source file to read its exports from")
    table = declared_exports(Path(source).read_text(encoding="utf-8"))

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__, sorted(table)
