"""Real pretrained models that install from the package index, located without a model hub.

Importing this package is cheap (no torch): it only reads installed distributions' file
lists. ``smollm2_gguf()`` is the path every demo, tutorial and test boots::

    from tl_core import TransformerBridge
    from tl_core.models import smollm2_gguf

    model = TransformerBridge.boot_transformers(smollm2_gguf())   # needs tl-driver-hf[gguf]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.models._bundled import (
        SMOLLM2 as SMOLLM2,
        BundledModel as BundledModel,
        smollm2_gguf as smollm2_gguf,
    )

__getattr__, __dir__, __all__ = attach(__name__)
