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

from tl_driver_hf.adapters._base import ArchitectureAdapter

_SHARED_NORM = (
    "falcon (7B layout) has one norm per block (input_layernorm) feeding both attention "
    "and the MLP; it is served as ln1.* (ln1.hook_out is also the MLP's input, mlp.hook_in); ln2.hook_in is the block input as "
    "the MLP's copy of that norm reads it, so an edit there reaches the MLP only"
)


ADAPTERS = (
    ArchitectureAdapter(
        family="falcon",
        model_types=("falcon",),
        architectures=("FalconForCausalLM",),
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
        norm="layernorm",
        parallel=True,
        mlp_out_inplace=True,
        absent={
            f"blocks.{{i}}.ln2.{suffix}": _SHARED_NORM
            for suffix in ("hook_scale", "hook_normalized", "hook_out")
        },
        config_requires={
            "new_decoder_architecture": (
                False,
                "Falcon-40B/180B's grouped fused layout and two norms are not mapped yet",
            ),
            "multi_query": (True, "only the multi-query (Falcon-7B) fused layout is mapped"),
            "alibi": (False, "Falcon-RW's ALiBi attention is not re-implemented"),
            "parallel_attn": (True, "only the parallel attention/MLP block is mapped"),
        },
        hub_patterns=(r"^tiiuae/falcon-7b",),
        known_models=("tiiuae/falcon-7b", "tiiuae/falcon-7b-instruct"),
    ),
)
