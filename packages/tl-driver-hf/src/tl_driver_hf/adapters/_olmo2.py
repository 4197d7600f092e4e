"""OLMo 2: no pre-norms; each sublayer's output is normalised before the residual add."""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("olmo2"),
        ln1=None,
        ln2=None,
        ln1_post="post_attention_layernorm",
        ln2_post="post_feedforward_layernorm",
        # OLMo 2 normalises the flat projections (all heads of a position together).
        q_norm="q_norm",
        k_norm="k_norm",
        qk_norm_layout="flat",
    ),
)
