"""Phi-3: Llama layout with a fused qkv projection and a fused gate/up projection."""

from __future__ import annotations

from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        family="phi3",
        model_types=("phi3",),
        architectures=("Phi3ForCausalLM",),
        q=None,
        k=None,
        v=None,
        qkv="qkv_proj",
        gate=None,
        up=None,
        gate_up="gate_up_proj",
        hub_patterns=(r"^microsoft/Phi-3", r"^microsoft/Phi-4-mini"),
        known_models=("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3.5-mini-instruct"),
    ),
)
