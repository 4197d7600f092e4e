"""The ``native`` driver: small random transformers in plain torch, for tests and toy work.

This module is what the ``tl_core.drivers`` entry point names, so it stays cheap: the
model and driver load only when the driver is booted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach
from tl_core.driver_api._discovery import DriverEntry
from tl_core.driver_api._protocol import FEATURES

if TYPE_CHECKING:
    from tl_core.native._config import NativeConfig as NativeConfig
    from tl_core.native._driver import NativeDriver as NativeDriver
    from tl_core.native._model import NativeTransformer as NativeTransformer

#: The ``native`` driver's entry, named by tl-core's ``tl_core.drivers`` entry point.
ENTRY = DriverEntry(
    name="native",
    distribution="tl-core",
    loader="tl_core.native._driver:NativeDriver",
    features=FEATURES - {"token_type_ids", "images"},
    kind="local",
    description="small random GPT-2- or Llama-style transformer in plain torch",
)

__getattr__, __dir__, _names = attach(__name__)
__all__ = ["ENTRY", *_names]
