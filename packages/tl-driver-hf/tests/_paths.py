"""Where each tiny family keeps its parts, written out independently of the driver's adapters.

The parity tests locate reference values with these paths; conftest parametrises the
family fixture over them.
"""

from __future__ import annotations

from typing import Any

# Where each family keeps its parts, written out independently of the driver's adapters:
# the parity tests locate reference values with these paths. Adding a family to the
# driver's tests is one entry here (keyed by its tiny-checkpoint name).
# Roles: embed, pos (learned positions), layers, final (norm), head; per layer ln1, ln2,
# ln1_post, ln2_post, attn, q/k/v or qkv (fused, [q|k|v]), o, mlp, pre (gate or input
# projection), pre_linear (up), gate_up (fused [gate|up]), down, q_norm/k_norm (inside
# attn); flags: rotary, rotary_table (attention receives its cos/sin table as the
# position_embeddings argument), conv1d (weights stored [in, out]), norm ("layernorm",
# "rms" or "rms_plus_one"), qk_norm_flat (the QK-norms see all heads of a position),
# qk_norm_heads_first (the QK-norms see [b, h, p, dh]), router (a mixture of experts'
# router inside mlp, returning logits, top-k weights and indices of flattened positions),
# experts_in (inside mlp: every expert's input weights stacked, [experts, out, d_model]),
# qkv_interleaved (the fused qkv is laid out per head, [h, (q, k, v), dh]), parallel
# (attention and MLP read the same block input).
_LLAMA = {
    "embed": "model.embed_tokens",
    "layers": "model.layers",
    "final": "model.norm",
    "head": "lm_head",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "attn": "self_attn",
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "mlp": "mlp",
    "pre": "gate_proj",
    "pre_linear": "up_proj",
    "down": "down_proj",
    "rotary": True,
    "rotary_table": True,
    "norm": "rms",
}
_QK_NORM = {"q_norm": "q_norm", "k_norm": "k_norm"}
_SANDWICH = {
    **_LLAMA,
    "ln1_post": "post_attention_layernorm",
    "ln2": "pre_feedforward_layernorm",
    "ln2_post": "post_feedforward_layernorm",
}
PATHS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "embed": "transformer.wte",
        "pos": "transformer.wpe",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "ln_1",
        "ln2": "ln_2",
        "attn": "attn",
        "qkv": "c_attn",
        "o": "c_proj",
        "mlp": "mlp",
        "pre": "c_fc",
        "down": "c_proj",
        "conv1d": True,
        "rotary": False,
        "norm": "layernorm",
    },
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": {**_LLAMA, **_QK_NORM},
    "mixtral": {
        **{k: v for k, v in _LLAMA.items() if k not in ("pre", "pre_linear", "down")},
        "router": "gate",
        "experts_in": "experts.gate_up_proj",
    },
    "phi3": {
        **{k: v for k, v in _LLAMA.items() if k not in ("q", "k", "v", "pre", "pre_linear")},
        "qkv": "qkv_proj",
        "gate_up": "gate_up_proj",
    },
    "gemma": {**_LLAMA, "norm": "rms_plus_one"},
    "gemma2": {**_SANDWICH, "norm": "rms_plus_one"},
    "gemma3": {**_SANDWICH, **_QK_NORM, "qk_norm_heads_first": True, "norm": "rms_plus_one"},
    "stablelm": {**_LLAMA, "norm": "layernorm"},
    "olmo2": {
        **{k: v for k, v in _LLAMA.items() if k not in ("ln1", "ln2")},
        "ln1_post": "post_attention_layernorm",
        "ln2_post": "post_feedforward_layernorm",
        **_QK_NORM,
        "qk_norm_flat": True,
    },
    "gpt_neox": {
        "embed": "gpt_neox.embed_in",
        "layers": "gpt_neox.layers",
        "final": "gpt_neox.final_layer_norm",
        "head": "lm_head",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
        "attn": "attention",
        "qkv": "query_key_value",
        "qkv_per_head": True,
        "qkv_interleaved": True,
        "o": "dense",
        "mlp": "mlp",
        "pre": "dense_h_to_4h",
        "down": "dense_4h_to_h",
        "rotary": True,
        "rotary_table": True,
        "parallel": True,
        "norm": "layernorm",
    },
    "gptj": {
        "embed": "transformer.wte",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "ln_1",
        "attn": "attn",
        "q": "q_proj",
        "k": "k_proj",
        "v": "v_proj",
        "o": "out_proj",
        "mlp": "mlp",
        "pre": "fc_in",
        "down": "fc_out",
        "rotary": True,
        "parallel": True,
        "norm": "layernorm",
    },
    "opt": {
        "embed": "model.decoder.embed_tokens",
        "pos": "model.decoder.embed_positions",
        "pos_offset": 2,
        "layers": "model.decoder.layers",
        "final": "model.decoder.final_layer_norm",
        "head": "lm_head",
        "ln1": "self_attn_layer_norm",
        "ln2": "final_layer_norm",
        "attn": "self_attn",
        "q": "q_proj",
        "k": "k_proj",
        "v": "v_proj",
        "o": "out_proj",
        "mlp": "",
        "mlp_inline": True,
        "flat_mlp": True,
        "pre": "fc1",
        "down": "fc2",
        "prescaled": True,
        "rotary": False,
        "norm": "layernorm",
    },
    # Families computing attention inside their modules; "inline" names how
    # tests/_inline_reference.py recomputes their attention internals.
    "gpt_neo": {
        "embed": "transformer.wte",
        "pos": "transformer.wpe",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "ln_1",
        "ln2": "ln_2",
        "attn": "attn.attention",
        "q": "q_proj",
        "k": "k_proj",
        "v": "v_proj",
        "o": "out_proj",
        "mlp": "mlp",
        "pre": "c_fc",
        "down": "c_proj",
        "rotary": False,
        "norm": "layernorm",
        "inline": "gpt_neo",
    },
    "bloom": {
        "embed": "transformer.word_embeddings",
        "embed_norm": "transformer.word_embeddings_layernorm",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
        "attn": "self_attention",
        "qkv": "query_key_value",
        "qkv_interleaved": True,
        "o": "dense",
        # The attention and MLP modules add the residual themselves.
        "attn_out": "dense",
        "mlp": "mlp",
        "mlp_out": "dense_4h_to_h",
        "pre": "dense_h_to_4h",
        "down": "dense_4h_to_h",
        "rotary": False,
        "norm": "layernorm",
        "inline": "bloom",
    },
    "falcon": {
        "embed": "transformer.word_embeddings",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "input_layernorm",
        "attn": "self_attention",
        "qkv": "query_key_value",
        "n_kv": 1,
        "o": "dense",
        "mlp": "mlp",
        "pre": "dense_h_to_4h",
        "down": "dense_4h_to_h",
        "rotary": True,
        "rotary_table": True,
        "parallel": True,
        "norm": "layernorm",
        "inline": "falcon",
    },
}


#: Every family this package's adapters serve, by tiny-checkpoint family name.
FAMILIES = tuple(PATHS)
#: Families whose attention and MLP run in sequence, and those that run them in parallel.
SEQUENTIAL = tuple(f for f, p in PATHS.items() if not p.get("parallel"))
PARALLEL = tuple(f for f, p in PATHS.items() if p.get("parallel"))
