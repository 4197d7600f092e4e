"""Phi-3: Llama layout with a fused qkv projection and a fused gate/up projection."""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("phi3"),
        q=None,
        k=None,
        v=None,
        qkv="qkv_proj",
        gate=None,
        up=None,
        gate_up="gate_up_proj",
    ),
)
