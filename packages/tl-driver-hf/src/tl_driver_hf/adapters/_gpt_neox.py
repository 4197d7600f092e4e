"""GPT-NeoX and Pythia: fused per-head ``query_key_value``, partial rotary, parallel block."""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("gpt_neox"),
        embed="gpt_neox.embed_in",
        layers="gpt_neox.layers",
        final_norm="gpt_neox.final_layer_norm",
        lm_head="lm_head",
        ln1="input_layernorm",
        ln2="post_attention_layernorm",
        attn="attention",
        q=None,
        k=None,
        v=None,
        qkv="query_key_value",
        # The fused projection is viewed as [.., heads, 3 * d_head]: q, k, v per head.
        qkv_layout="heads",
        o="dense",
        mlp="mlp",
        mlp_in="dense_h_to_4h",
        gate=None,
        up=None,
        down="dense_4h_to_h",
        # Rotary covers only the first rotary_pct of each head; hook_rot_q/k hold the whole
        # head as attention receives it.
    ),
)
