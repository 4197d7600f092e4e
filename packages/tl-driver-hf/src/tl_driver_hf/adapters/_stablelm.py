"""StableLM: the Llama layout with LayerNorm (and partial rotary, applied inside attention)."""

from __future__ import annotations

from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        family="stablelm",
        model_types=("stablelm",),
        architectures=("StableLmForCausalLM",),
        norm="layernorm",
        hub_patterns=(r"^stabilityai/stablelm-",),
        known_models=("stabilityai/stablelm-2-1_6b", "stabilityai/stablelm-3b-4e1t"),
    ),
)
