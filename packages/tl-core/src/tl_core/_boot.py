"""``boot``: one call from a driver name to a ready bridge."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tl_core._discovery import get_driver_entry

if TYPE_CHECKING:
    from tl_core._bridge import TransformerBridge
    from tl_core._remote_bridge import RemoteBridge

__all__ = ["boot"]


def boot(model: Any = None, *, driver: str = "hf", **options: Any) -> TransformerBridge | RemoteBridge:
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
    entry = get_driver_entry(driver)
    driver_cls = entry.load()
    instance = driver_cls.boot(model, **options)
    if entry.kind == "remote":
        from tl_core._remote_bridge import RemoteBridge

        return RemoteBridge(instance)
    from tl_core._bridge import TransformerBridge

    return TransformerBridge(instance)
