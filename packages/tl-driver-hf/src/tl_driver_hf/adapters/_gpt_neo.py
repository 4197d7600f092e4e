"""GPT-Neo: learned positions, LayerNorm, separate bias-free q/k/v, unscaled scores.

GPT-Neo computes attention inside ``GPTNeoSelfAttention`` (not through
``AttentionInterface``), so the driver runs its hooked re-implementation there
(``inline_attention="gpt_neo"``). Its scores are ``q k^T`` without the usual
``1/sqrt(d_head)`` (the checkpoints were trained that way), taken in float32, and masked by
the layer's own table: causal on global layers, a sliding window of ``window_size`` keys
on local ones (``hook_attn_scores`` holds ``-inf`` outside the window).
"""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("gpt_neo"),
        embed="transformer.wte",
        pos_embed="transformer.wpe",
        layers="transformer.h",
        final_norm="transformer.ln_f",
        ln1="ln_1",
        ln2="ln_2",
        # GPTNeoAttention only dispatches to the module holding the projections.
        attn="attn.attention",
        o="out_proj",
        mlp="mlp",
        mlp_in="c_fc",
        gate=None,
        up=None,
        down="c_proj",
        inline_attention="gpt_neo",
    ),
)
