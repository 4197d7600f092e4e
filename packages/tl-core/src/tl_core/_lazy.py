"""Lazy package exports: a name is imported from its module on first access.

tl's packages are imported on cheap paths (the ``tl_core.drivers`` entry-point scan, the
``tl`` command) that must not pay for torch. Each package lists its exports once, as
``{name: submodule}``; the module that holds a name is imported when the name is first
used and the value is then cached in the package namespace.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["attach"]


def attach(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of a package with lazy exports.

    Args:
        package: The package's ``__name__``.
        exports: Exported name -> the module that defines it: a submodule of ``package``
            (``"_cache"``) or an absolute module name (``"tl_core.cache._readout"``).

    Returns:
        ``(__getattr__, __dir__, __all__)`` to assign at the package's top level.
    """
    table = dict(exports)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        path = module if module.startswith("tl_core.") else f"{package}.{module}"
        value = getattr(importlib.import_module(path), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__, sorted(table)
