"""The researcher-facing bridges over drivers, and ``boot``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.bridges._boot import boot as boot
    from tl_core.bridges._remote import RemoteBridge as RemoteBridge
    from tl_core.bridges._transformer import TransformerBridge as TransformerBridge

__getattr__, __dir__, __all__ = attach(__name__)
