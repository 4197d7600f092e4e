"""Llama-style decoders: pre-RMSNorm, rotary, separate q/k/v, gated SiLU MLP."""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("llama"),
    ),
    ArchitectureAdapter(
        description=family_named("mistral"),
    ),
    ArchitectureAdapter(
        description=family_named("qwen2"),
    ),
    ArchitectureAdapter(
        description=family_named("qwen3"),
        # q_norm/k_norm sit between hook_q/hook_k (projection outputs) and hook_rot_q/k.
        q_norm="q_norm",
        k_norm="k_norm",
    ),
)
