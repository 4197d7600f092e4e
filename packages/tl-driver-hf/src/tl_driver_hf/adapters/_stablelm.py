"""StableLM: the Llama layout with LayerNorm (and partial rotary, applied inside attention)."""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("stablelm"),
    ),
)
