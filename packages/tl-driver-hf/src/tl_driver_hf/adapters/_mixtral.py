"""Mixtral: Mistral attention with a sparse mixture-of-experts MLP."""

from __future__ import annotations

from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        family="mixtral",
        model_types=("mixtral",),
        architectures=("MixtralForCausalLM",),
        gate=None,
        up=None,
        down=None,
        moe=True,
        router="gate",
        expert_in="experts.gate_up_proj",
        hub_patterns=(r"^mistralai/Mixtral-",),
        known_models=("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    ),
)
