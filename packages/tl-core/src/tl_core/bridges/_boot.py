"""``boot``: one call from a driver name to the matching ready bridge."""

from __future__ import annotations

from typing import Any

from tl_core.bridges._remote import RemoteBridge
from tl_core.bridges._transformer import TransformerBridge
from tl_core.driver_api._discovery import get_driver_entry

__all__ = ["boot"]


def boot(
    model: Any = None, *, driver: str = "hf", **options: Any
) -> TransformerBridge | RemoteBridge:
    """Load ``model`` with the named driver and wrap it in the matching bridge.

    Args:
        model: What the driver loads: a hub id or folder (``hf``, ``vllm``), a config
            (``native``), ...
        driver: A driver name from ``tl drivers`` (``native``, ``hf``, ``vllm``, ``inspect``).
        **options: Driver options (see each driver's ``boot``).

    Returns:
        A ``TransformerBridge`` for local drivers, a ``RemoteBridge`` for engines.

    Raises:
        DriverNotFoundError: The driver is not installed (the message says what to install).
        EngineVersionError: Its engine is missing or outside the supported range.
    """
    kind = get_driver_entry(driver).kind
    bridge = TransformerBridge if kind == "local" else RemoteBridge
    return bridge.boot(model, driver=driver, **options)
