"""GPT-2 (and stanford-crfm's GPT-2 checkpoints): learned positions, LayerNorm, fused Conv1D."""

from __future__ import annotations

from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        family="gpt2",
        model_types=("gpt2",),
        architectures=("GPT2LMHeadModel",),
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
        norm="layernorm",
        rotary=False,
        # GPT-2's eager attention takes the softmax in the activations' dtype.
        softmax_fp32=False,
        hub_patterns=(
            r"^(openai-community/)?(distil)?gpt2(-medium|-large|-xl)?$",
            r"^stanford-crfm/",
        ),
        known_models=(
            "openai-community/gpt2",
            "openai-community/gpt2-medium",
            "openai-community/gpt2-large",
            "openai-community/gpt2-xl",
            "distilbert/distilgpt2",
            "stanford-crfm/alias-gpt2-small-x21",
            "stanford-crfm/battlestar-gpt2-small-x49",
        ),
    ),
)
