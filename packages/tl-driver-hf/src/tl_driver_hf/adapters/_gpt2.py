"""GPT-2 (and stanford-crfm's GPT-2 checkpoints): learned positions, LayerNorm, fused Conv1D."""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("gpt2"),
        embed="transformer.wte",
        pos_embed="transformer.wpe",
        layers="transformer.h",
        final_norm="transformer.ln_f",
        ln1="ln_1",
        ln2="ln_2",
        attn="attn",
        q=None,
        k=None,
        v=None,
        qkv="c_attn",
        o="c_proj",
        mlp="mlp",
        mlp_in="c_fc",
        gate=None,
        up=None,
        down="c_proj",
        linear="conv1d",
        # GPT-2's eager attention takes the softmax in the activations' dtype.
        softmax_fp32=False,
    ),
)
