"""Sparse dictionaries (SAEs and transcoders) in tl: their tensors and sae-lens's inference
math (``SparseDictionary``), loaded from sae-lens's folder format or ``SAE`` objects, and
spliced into a local driver's forward pass (``splice``).

Work in progress (issue #20): feature-level sites, transcoders and vLLM come next.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.sae._dictionary import (
        ARCHITECTURES as ARCHITECTURES,
        NORMALIZATIONS as NORMALIZATIONS,
        SparseDictionary as SparseDictionary,
    )
    from tl_core.sae._load import from_sae_lens as from_sae_lens, load_dictionary as load_dictionary
    from tl_core.sae._splice import Splice as Splice, splice as splice

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "ARCHITECTURES": "_dictionary",
        "NORMALIZATIONS": "_dictionary",
        "SparseDictionary": "_dictionary",
        "from_sae_lens": "_load",
        "load_dictionary": "_load",
        "Splice": "_splice",
        "splice": "_splice",
    },
)
