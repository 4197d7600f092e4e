"""Falcon (Falcon-7B layout): multi-query attention, rotary, parallel attention and MLP.

One shared key/value head (``n_key_value_heads = 1``); the fused ``query_key_value``
is laid out ``[q heads | key head | value head]``, so ``hook_q``/``hook_k`` split it like
any ``[q | k | v]`` projection. Attention and the MLP read the same normalised input
(``input_layernorm``), served as ``ln1.*``; there is no second norm module, so
``ln2.hook_scale``/``hook_normalized``/``hook_out`` are non-fireable with the reason, and
``ln2.hook_in`` is the block input the MLP reads through its own copy of that norm (an edit
there reaches the MLP only).
The layer adds the attention output into the MLP's output tensor in place, so
``mlp.hook_out`` hands the layer a copy (``mlp_out_inplace``).

transformers 5.25 computes attention through ``AttentionInterface``; earlier 5.x releases
compute it inside ``FalconAttention``, where the driver runs its hooked re-implementation
(``falcon_legacy``, picked by ``LEGACY_FORWARDS`` where the module has ``_split_heads``).
Falcon-40B/180B (``new_decoder_architecture``) and Falcon-RW (ALiBi, per-head fused
layout) are refused at boot with the reason.
"""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("falcon"),
        embed="transformer.word_embeddings",
        layers="transformer.h",
        final_norm="transformer.ln_f",
        ln1="input_layernorm",
        ln2=None,
        attn="self_attention",
        q=None,
        k=None,
        v=None,
        qkv="query_key_value",
        o="dense",
        mlp="mlp",
        mlp_in="dense_h_to_4h",
        gate=None,
        up=None,
        down="dense_4h_to_h",
        mlp_out_inplace=True,
    ),
)
