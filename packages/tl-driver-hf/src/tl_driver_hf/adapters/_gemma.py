"""Gemma 1/2/3: (1 + w) RMSNorm, sqrt(d_model) embedding scale; 2 and 3 have sandwich norms."""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("gemma"),
    ),
    ArchitectureAdapter(
        description=family_named("gemma2"),
        ln1_post="post_attention_layernorm",
        ln2="pre_feedforward_layernorm",
        ln2_post="post_feedforward_layernorm",
    ),
    ArchitectureAdapter(
        description=family_named("gemma3"),
        ln1_post="post_attention_layernorm",
        ln2="pre_feedforward_layernorm",
        ln2_post="post_feedforward_layernorm",
        q_norm="q_norm",
        k_norm="k_norm",
        # Gemma 3 normalises queries and keys after moving heads before positions.
        qk_norm_layout="heads_first",
    ),
)
