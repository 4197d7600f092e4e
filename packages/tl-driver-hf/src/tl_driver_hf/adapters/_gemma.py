"""Gemma 1/2/3: (1 + w) RMSNorm, sqrt(d_model) embedding scale; 2 and 3 have sandwich norms."""

from __future__ import annotations

from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        family="gemma",
        model_types=("gemma",),
        architectures=("GemmaForCausalLM",),
        norm="rms_plus_one",
        embed_scaled=True,
        hub_patterns=(r"^google/gemma-(1\.1-)?\d+b", r"^google/codegemma-"),
        known_models=("google/gemma-2b", "google/gemma-7b", "google/gemma-1.1-2b-it"),
    ),
    ArchitectureAdapter(
        family="gemma2",
        model_types=("gemma2",),
        architectures=("Gemma2ForCausalLM",),
        ln1_post="post_attention_layernorm",
        ln2="pre_feedforward_layernorm",
        ln2_post="post_feedforward_layernorm",
        norm="rms_plus_one",
        embed_scaled=True,
        attn_softcap="attn_logit_softcapping",
        final_softcap="final_logit_softcapping",
        hub_patterns=(r"^google/gemma-2-",),
        known_models=("google/gemma-2-2b", "google/gemma-2-9b", "google/gemma-2-2b-it"),
    ),
    ArchitectureAdapter(
        family="gemma3",
        model_types=("gemma3_text",),
        architectures=("Gemma3ForCausalLM",),
        ln1_post="post_attention_layernorm",
        ln2="pre_feedforward_layernorm",
        ln2_post="post_feedforward_layernorm",
        norm="rms_plus_one",
        embed_scaled=True,
        attn_softcap="attn_logit_softcapping",
        final_softcap="final_logit_softcapping",
        q_norm="q_norm",
        k_norm="k_norm",
        # Gemma 3 normalises queries and keys after moving heads before positions.
        qk_norm_layout="heads_first",
        hub_patterns=(r"^google/gemma-3-(270m|1b)",),
        known_models=("google/gemma-3-270m", "google/gemma-3-1b-pt", "google/gemma-3-1b-it"),
    ),
)
