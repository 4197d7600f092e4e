"""tl inside inspect_ai evals: model providers, activation capture and steering solvers.

* Providers (registered through the ``inspect_ai`` entry point): ``tl_bridge/<model>``
  runs tl's hf driver, ``tl_bridge_vllm/<model>`` tl's vLLM driver
  (``pip install tl-driver-vllm``). An absolute path needs a double slash:
  ``tl_bridge//abs/path``.
* Solvers: ``intervene(specs)`` steers a sample's generations; ``capture_activations(
  hooks, output_dir=...)`` generates and writes one safetensors file per sample and epoch.
* Driver ``inspect`` (``RemoteBridge.boot_inspect``) for analysis code on a provider.
* ``eval_dataframe(log)`` and ``load_activations(frame, hook)``: an eval log's scores and
  capture summaries as a data frame, and the captured tensors as a probe-ready batch.

This module is what the ``tl_core.drivers`` entry point names, so it stays cheap: inspect,
torch and transformers load on first use of a name below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tl_core.driver_api import DriverEntry, EngineRequirement
from tl_driver_inspect._version import __version__

if TYPE_CHECKING:
    from tl_driver_inspect._analysis import (
        eval_dataframe as eval_dataframe,
        load_activations as load_activations,
    )
    from tl_driver_inspect._driver import InspectDriver as InspectDriver
    from tl_driver_inspect._provider import TLBridgeAPI as TLBridgeAPI, TLProvider as TLProvider
    from tl_driver_inspect._solvers import (
        capture_activations as capture_activations,
        intervene as intervene,
    )
    from tl_driver_inspect._vllm_provider import TLBridgeVLLMAPI as TLBridgeVLLMAPI

__all__ = [
    "ENGINE",
    "ENTRY",
    "capture_activations",
    "eval_dataframe",
    "intervene",
    "load_activations",
    "TLProvider",
    "TLBridgeAPI",
    "TLBridgeVLLMAPI",
    "InspectDriver",
    "__version__",
]

#: The tested inspect_ai window, as pyproject.toml declares it (the providers subclass its
#: ``ModelAPI``).
ENGINE = EngineRequirement.declared_by("tl-driver-inspect", ("inspect-ai",))

#: The ``inspect`` driver's entry, named by this distribution's ``tl_core.drivers`` entry point.
ENTRY = DriverEntry(
    name="inspect",
    distribution="tl-driver-inspect",
    loader="tl_driver_inspect._driver:InspectDriver",
    engine=ENGINE,
    features=frozenset({"generation", "batching", "position_interventions"}),
    kind="remote",
    description="an inspect_ai model provider (tl_bridge, tl_bridge_vllm): capture and steering in evals",
)

_LAZY = {
    "capture_activations": "tl_driver_inspect._solvers",
    "intervene": "tl_driver_inspect._solvers",
    "TLProvider": "tl_driver_inspect._provider",
    "TLBridgeAPI": "tl_driver_inspect._provider",
    "TLBridgeVLLMAPI": "tl_driver_inspect._vllm_provider",
    "InspectDriver": "tl_driver_inspect._driver",
    "eval_dataframe": "tl_driver_inspect._analysis",
    "load_activations": "tl_driver_inspect._analysis",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tl_driver_inspect' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
