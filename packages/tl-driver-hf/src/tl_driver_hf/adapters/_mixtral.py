"""Mixtral: Mistral attention with a sparse mixture-of-experts MLP."""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("mixtral"),
        gate=None,
        up=None,
        down=None,
        router="gate",
        expert_in="experts.gate_up_proj",
    ),
)
