"""The table of architecture adapters, keyed by ``model_type`` and architecture class name.

Every module ``tl_driver_hf.adapters._<family>`` that defines ``ADAPTERS`` (a tuple of
``ArchitectureAdapter``) is registered automatically, so the hf side of a family is one new
file of module paths next to its ``tl_core.architecture`` description (see
``docs/adding-a-family.md``). Importing this package loads only those data modules.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from tl_driver_hf.adapters._base import ArchitectureAdapter, LinearKind

__all__ = [
    "ArchitectureAdapter",
    "LinearKind",
    "all_adapters",
    "find_adapter",
    "register_adapter",
]

_EXTRA: list[ArchitectureAdapter] = []


@lru_cache(maxsize=1)
def _builtin() -> tuple[ArchitectureAdapter, ...]:
    found: list[ArchitectureAdapter] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_") or info.name == "_base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found.extend(getattr(module, "ADAPTERS", ()))
    return tuple(found)


def all_adapters() -> tuple[ArchitectureAdapter, ...]:
    """Every registered adapter: the built-in families, then ``register_adapter`` ones."""
    return (*_builtin(), *_EXTRA)


def register_adapter(adapter: ArchitectureAdapter) -> None:
    """Add an adapter at run time (e.g. for a custom ``trust_remote_code`` family).

    Args:
        adapter: The adapter; it takes precedence over built-in ones with the same keys.

    Raises:
        TypeError: ``adapter`` is not an ``ArchitectureAdapter``.
    """
    if not isinstance(adapter, ArchitectureAdapter):
        raise TypeError(
            f"register_adapter takes an ArchitectureAdapter, got {type(adapter).__name__}"
        )
    _EXTRA.insert(0, adapter)


def find_adapter(
    model_type: str | None = None, architectures: tuple[str, ...] | list[str] | None = None
) -> ArchitectureAdapter | None:
    """The adapter serving ``model_type`` or one of ``architectures``, or ``None``.

    Architecture class names win over ``model_type`` (a ``model_type`` can cover several
    heads, only ``*ForCausalLM`` ones are served).
    """
    adapters = (*_EXTRA, *_builtin())
    for arch in architectures or ():
        for adapter in adapters:
            if arch in adapter.architectures:
                return adapter
    if model_type:
        for adapter in adapters:
            if model_type in adapter.model_types:
                return adapter
    return None
