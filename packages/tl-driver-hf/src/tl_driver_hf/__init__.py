"""The ``hf`` driver of tl: HuggingFace transformers models with the full hook tree.

Importing this package is cheap (no torch, no transformers): the ``tl_core.drivers`` entry
point scan and ``tl_driver_hf.testing`` import it. The driver and helpers load on first
use::

    from tl_core import TransformerBridge

    bridge = TransformerBridge.boot_transformers("path/to/folder")
    logits, cache = bridge.run_with_cache("Hello")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tl_core.driver_api import FEATURES, DriverEntry, EngineRequirement
from tl_driver_hf._version import __version__

if TYPE_CHECKING:
    from tl_driver_hf._architecture._describe import ArchitectureDescription, describe_architecture
    from tl_driver_hf._driver import HFDriver
    from tl_driver_hf._runtime._arena import CaptureArena
    from tl_driver_hf._support import (
        SupportReport,
        build_bridge_config_from_hf,
        build_bridge_from_module,
        check_model_support,
        list_supported_models,
    )
    from tl_driver_hf._weights._tokenizer import detect_tokenizer_bos_eos
    from tl_driver_hf.adapters import ArchitectureAdapter, register_adapter

__all__ = [
    "ENTRY",
    "ArchitectureAdapter",
    "ArchitectureDescription",
    "CaptureArena",
    "HFDriver",
    "SupportReport",
    "__version__",
    "build_bridge_config_from_hf",
    "build_bridge_from_module",
    "check_model_support",
    "describe_architecture",
    "detect_tokenizer_bos_eos",
    "list_supported_models",
    "register_adapter",
]

#: The ``hf`` driver's entry, named by this distribution's ``tl_core.drivers`` entry point.
ENTRY = DriverEntry(
    name="hf",
    distribution="tl-driver-hf",
    loader="tl_driver_hf._driver:HFDriver",
    engine=EngineRequirement.declared_by("tl-driver-hf", ("transformers",)),
    features=FEATURES,
    kind="local",
    description="HuggingFace transformers models: full hook tree, gradients, weights",
)

_LAZY = {
    "CaptureArena": "tl_driver_hf._runtime._arena",
    "HFDriver": "tl_driver_hf._driver",
    "detect_tokenizer_bos_eos": "tl_driver_hf._weights._tokenizer",
    "SupportReport": "tl_driver_hf._support",
    "build_bridge_config_from_hf": "tl_driver_hf._support",
    "build_bridge_from_module": "tl_driver_hf._support",
    "check_model_support": "tl_driver_hf._support",
    "list_supported_models": "tl_driver_hf._support",
    "ArchitectureAdapter": "tl_driver_hf.adapters",
    "ArchitectureDescription": "tl_driver_hf._architecture._describe",
    "describe_architecture": "tl_driver_hf._architecture._describe",
    "register_adapter": "tl_driver_hf.adapters",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tl_driver_hf' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
