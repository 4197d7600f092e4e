"""Which architectures a driver declares it serves, and what a boot failure means for the card.

The report card SKIPs a family a driver refuses on purpose and FAILs one it should have
served: a refusal (``ConfigError``, ``UnsupportedFeatureError``) of an architecture the
driver does not declare is a SKIP; a refusal of one it declares, or any other boot failure,
is a FAIL. A driver declares its architectures with a ``supported_architectures`` attribute
on its class (a collection of ``config.architectures`` names, or a function returning one);
the first-party drivers that predate the attribute are read from their own family tables.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tl_parity._tolerance import engine_of

__all__ = [
    "REFUSAL_ERRORS",
    "boot_failure_facts",
    "checkpoint_architecture",
    "declared_architectures",
]

#: Error types (or base types) by which a driver refuses a model on purpose at boot.
REFUSAL_ERRORS: frozenset[str] = frozenset({"ConfigError", "UnsupportedFeatureError"})


def _hf_architectures() -> Iterable[str]:
    from tl_driver_hf.adapters import all_adapters

    return [arch for adapter in all_adapters() for arch in adapter.architectures]


def _vllm_architectures() -> Iterable[str]:
    from tl_driver_vllm import supported_architectures

    return supported_architectures()


#: First-party drivers whose class does not carry ``supported_architectures``: their packages' tables.
_FAMILY_TABLES: Mapping[str, Callable[[], Iterable[str]]] = {
    "hf": _hf_architectures,
    "vllm": _vllm_architectures,
}


def declared_architectures(
    driver: str, options: Mapping[str, Any] | None = None
) -> frozenset[str] | None:
    """The ``config.architectures`` names ``driver`` declares it serves, or ``None`` if unknown.

    Args:
        driver: The driver name; ``inspect`` answers for the engine its provider runs.
        options: The driver's boot options (``inspect``'s ``provider``).

    Returns:
        The declared names; ``None`` when the driver declares nothing or cannot be loaded.
    """
    name = engine_of(driver, options)
    declared: Any = None
    try:
        from tl_core.driver_api import get_driver_entry

        module, _, attr = get_driver_entry(name).loader.partition(":")
        declared = getattr(
            getattr(importlib.import_module(module), attr), "supported_architectures", None
        )
        if callable(declared):
            declared = declared()
    except Exception:  # a driver that does not load declares nothing; its boot error says why
        declared = None
    if declared is None and name in _FAMILY_TABLES:
        try:
            declared = _FAMILY_TABLES[name]()
        except Exception:  # the driver's own package is broken: nothing declared
            declared = None
    if declared is None or isinstance(declared, str):
        return None
    return frozenset(str(a) for a in declared)


def checkpoint_architecture(model: str) -> str | None:
    """``architectures[0]`` of a checkpoint folder's ``config.json`` (or its text config)."""
    try:
        data = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for config in (data, data.get("text_config") if isinstance(data, dict) else None):
        archs = config.get("architectures") if isinstance(config, dict) else None
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
    return None


def boot_failure_facts(
    exc: BaseException,
    *,
    stage: str,
    driver: str,
    model: str,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What the card needs to judge a failure: where it happened, its types, what was declared.

    Args:
        exc: The exception the driver process caught.
        stage: ``"boot"`` (``tl_core.boot`` raised) or ``"run"`` (later).
        driver: The driver name.
        model: What the driver was asked to load.
        options: The driver's boot options.

    Returns:
        A JSON-ready dict: ``stage``, ``error_type``, ``error_types`` (the exception's class
        and its bases), ``refusal`` (a deliberate refusal at boot), ``architecture`` (of
        the checkpoint, when its folder says) and ``declared`` (whether the driver declares
        that architecture; ``None`` when either side is unknown).
    """
    types = [cls.__name__ for cls in type(exc).__mro__ if cls not in (BaseException, object)]
    refusal = stage == "boot" and bool(REFUSAL_ERRORS.intersection(types))
    facts: dict[str, Any] = {
        "stage": stage,
        "error_type": type(exc).__name__,
        "error_types": types,
        "refusal": refusal,
        "architecture": None,
        "declared": None,
    }
    if refusal:
        arch = checkpoint_architecture(model)
        listed = declared_architectures(driver, options) if arch is not None else None
        facts["architecture"] = arch
        facts["declared"] = None if listed is None else arch in listed
    return facts
