"""The ``native`` driver: small random transformers in plain torch, for tests and toy work.

This module is what the ``tl_core.drivers`` entry point names, so it stays cheap: the
model and driver load only when the driver is booted.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tl_core._discovery import DriverEntry
from tl_core._driver import FEATURES

if TYPE_CHECKING:
    from tl_core.native._config import NativeConfig
    from tl_core.native._driver import NativeDriver
    from tl_core.native._model import NativeTransformer

__all__ = ["ENTRY", "NativeConfig", "NativeDriver", "NativeTransformer"]

ENTRY = DriverEntry(
    name="native",
    distribution="tl-core",
    loader="tl_core.native._driver:NativeDriver",
    features=FEATURES,
    kind="local",
    description="small random GPT-2- or Llama-style transformer in plain torch",
)

_LAZY = {
    "NativeConfig": "tl_core.native._config",
    "NativeDriver": "tl_core.native._driver",
    "NativeTransformer": "tl_core.native._model",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tl_core.native' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
