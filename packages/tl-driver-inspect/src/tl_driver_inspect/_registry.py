"""inspect_ai registrations (the ``inspect_ai`` entry point names this module).

inspect imports every ``inspect_ai`` entry point at each eval start, so this stays cheap:
the provider classes (and torch, transformers, vLLM) load only when a model is built.
TransformerLens 4.3 registers providers with the same names (``tl_bridge``,
``tl_bridge_vllm``); inspect then takes whichever entry point loaded first. ``tl_hf`` and
``tl_vllm`` name this package's providers unambiguously.
Importing the solvers registers ``tl_driver_inspect/capture_activations`` and
``tl_driver_inspect/intervene`` for task files.
"""

from __future__ import annotations

from typing import Any

from inspect_ai.model import modelapi

from tl_driver_inspect import _solvers  # noqa: F401  (registers the solvers)


@modelapi(name="tl_bridge")
def tl_bridge() -> type[Any]:
    """``tl_bridge/<model>``: tl's hf driver as an inspect model provider."""
    from tl_driver_inspect._provider import TLBridgeAPI

    return TLBridgeAPI


@modelapi(name="tl_bridge_vllm")
def tl_bridge_vllm() -> type[Any]:
    """``tl_bridge_vllm/<model>``: tl's vLLM driver (``pip install tl-driver-vllm``)."""
    from tl_driver_inspect._vllm_provider import TLBridgeVLLMAPI

    return TLBridgeVLLMAPI


@modelapi(name="tl_hf")
def tl_hf() -> type[Any]:
    """``tl_hf/<model>``: the same provider as ``tl_bridge``, under a name no other package uses."""
    from tl_driver_inspect._provider import TLBridgeAPI

    return TLBridgeAPI


@modelapi(name="tl_vllm")
def tl_vllm() -> type[Any]:
    """``tl_vllm/<model>``: the same provider as ``tl_bridge_vllm``, under an unambiguous name."""
    from tl_driver_inspect._vllm_provider import TLBridgeVLLMAPI

    return TLBridgeVLLMAPI
