"""OLMo 2: no pre-norms; each sublayer's output is normalised before the residual add."""

from __future__ import annotations

from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        family="olmo2",
        model_types=("olmo2",),
        architectures=("Olmo2ForCausalLM",),
        ln1=None,
        ln2=None,
        ln1_post="post_attention_layernorm",
        ln2_post="post_feedforward_layernorm",
        norm="rms_weight_first",
        # OLMo 2 normalises the flat projections (all heads of a position together).
        q_norm="q_norm",
        k_norm="k_norm",
        qk_norm_layout="flat",
        hub_patterns=(r"^allenai/OLMo-2-",),
        known_models=("allenai/OLMo-2-0425-1B", "allenai/OLMo-2-1124-7B"),
    ),
)
