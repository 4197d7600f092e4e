"""The activation cache and the residual-stream analysis done on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.cache._cache import (
        ActivationCache as ActivationCache,
        tl_style_name as tl_style_name,
    )
    from tl_core.cache._readout import ModelReadout as ModelReadout

__getattr__, __dir__, __all__ = attach(__name__)
