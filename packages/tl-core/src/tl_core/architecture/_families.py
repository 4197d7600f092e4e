"""The hand-written family descriptions: one row per family, every driver's one source.

A row holds what the family is (``FamilyDescription``); where an engine keeps its modules is
the driver's row (``tl_driver_hf.adapters``, ``tl_driver_vllm``'s layouts), which names the
family. Defaults are Llama's: RMS norms before attention and before the MLP, rotary
positions, a gated MLP, a final norm. A config requirement belongs here when no driver can
serve that config with this description; one only an engine cannot run stays in that
engine's row. See ``docs/adding-a-family.md``.
"""

from __future__ import annotations

from tl_core.architecture._family import FamilyDescription

__all__ = ["FAMILIES", "all_families", "family_description", "family_named"]

_MOE_RENORMALISED = "norm_topk_prob"

FAMILIES: tuple[FamilyDescription, ...] = (
    FamilyDescription(
        family="llama",
        model_types=("llama",),
        architectures=("LlamaForCausalLM",),
        hub_patterns=(r"^meta-llama/", r"llama", r"^TinyLlama/", r"^HuggingFaceTB/SmolLM"),
        known_models=(
            "meta-llama/Llama-3.2-1B",
            "meta-llama/Llama-3.1-8B",
            "meta-llama/Llama-2-7b-hf",
            "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
            "HuggingFaceTB/SmolLM2-135M",
        ),
    ),
    FamilyDescription(
        family="mistral",
        model_types=("mistral",),
        architectures=("MistralForCausalLM",),
        hub_patterns=(r"^mistralai/Mistral-",),
        known_models=("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.3"),
    ),
    FamilyDescription(
        family="qwen2",
        model_types=("qwen2",),
        architectures=("Qwen2ForCausalLM",),
        hub_patterns=(r"^Qwen/Qwen2(\.5)?-",),
        known_models=("Qwen/Qwen2-0.5B", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B-Instruct"),
    ),
    FamilyDescription(
        family="qwen3",
        model_types=("qwen3",),
        architectures=("Qwen3ForCausalLM",),
        qk_norm="per_head",
        hub_patterns=(r"^Qwen/Qwen3-",),
        known_models=("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B"),
    ),
    FamilyDescription(
        family="phi3",
        model_types=("phi3",),
        architectures=("Phi3ForCausalLM",),
        hub_patterns=(r"^microsoft/Phi-3", r"^microsoft/Phi-4-mini"),
        known_models=("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3.5-mini-instruct"),
    ),
    FamilyDescription(
        family="stablelm",
        model_types=("stablelm",),
        architectures=("StableLmForCausalLM",),
        norm="layernorm",
        config_requires={
            "use_parallel_residual": (
                False,
                "the parallel-residual StableLM block (one norm feeding attention and the MLP) "
                "is not described",
            ),
            "qk_layernorm": (False, "StableLM's per-head query/key LayerNorms are not described"),
        },
        hub_patterns=(r"^stabilityai/stablelm-",),
        known_models=("stabilityai/stablelm-2-1_6b", "stabilityai/stablelm-3b-4e1t"),
    ),
    FamilyDescription(
        family="gemma",
        model_types=("gemma",),
        architectures=("GemmaForCausalLM",),
        norm="rms_plus_one",
        embed_scaled=True,
        hub_patterns=(r"^google/gemma-(1\.1-)?\d+b", r"^google/codegemma-"),
        known_models=("google/gemma-2b", "google/gemma-7b", "google/gemma-1.1-2b-it"),
    ),
    FamilyDescription(
        family="gemma2",
        model_types=("gemma2",),
        architectures=("Gemma2ForCausalLM",),
        norm="rms_plus_one",
        norm_after_attn=True,
        norm_after_mlp=True,
        embed_scaled=True,
        attn_softcap="attn_logit_softcapping",
        final_softcap="final_logit_softcapping",
        hub_patterns=(r"^google/gemma-2-",),
        known_models=("google/gemma-2-2b", "google/gemma-2-9b", "google/gemma-2-2b-it"),
    ),
    FamilyDescription(
        family="gemma3",
        model_types=("gemma3_text",),
        architectures=("Gemma3ForCausalLM",),
        norm="rms_plus_one",
        norm_after_attn=True,
        norm_after_mlp=True,
        embed_scaled=True,
        qk_norm="per_head",
        attn_softcap="attn_logit_softcapping",
        final_softcap="final_logit_softcapping",
        hub_patterns=(r"^google/gemma-3-(270m|1b)",),
        known_models=("google/gemma-3-270m", "google/gemma-3-1b-pt", "google/gemma-3-1b-it"),
    ),
    FamilyDescription(
        family="olmo2",
        model_types=("olmo2",),
        architectures=("Olmo2ForCausalLM",),
        norm="rms_weight_first",
        norm_before_attn=False,
        norm_before_mlp=False,
        norm_after_attn=True,
        norm_after_mlp=True,
        qk_norm="across_heads",
        hub_patterns=(r"^allenai/OLMo-2-",),
        known_models=("allenai/OLMo-2-0425-1B", "allenai/OLMo-2-1124-7B"),
    ),
    # EXAONE 4: OLMo 2's block (no pre-norms, a norm after each sublayer), QK-norms per head.
    FamilyDescription(
        family="exaone4",
        model_types=("exaone4",),
        architectures=("Exaone4ForCausalLM",),
        norm_before_attn=False,
        norm_before_mlp=False,
        norm_after_attn=True,
        norm_after_mlp=True,
        qk_norm="per_head",
    ),
    FamilyDescription(
        family="mixtral",
        model_types=("mixtral",),
        architectures=("MixtralForCausalLM",),
        mlp_variant="moe",
        hub_patterns=(r"^mistralai/Mixtral-",),
        known_models=("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    ),
    FamilyDescription(
        family="qwen2_moe",
        model_types=("qwen2_moe",),
        architectures=("Qwen2MoeForCausalLM",),
        mlp_variant="moe",
        renormalize_field=_MOE_RENORMALISED,
    ),
    FamilyDescription(
        family="qwen3_moe",
        model_types=("qwen3_moe",),
        architectures=("Qwen3MoeForCausalLM",),
        qk_norm="per_head",
        mlp_variant="moe",
        renormalize_field=_MOE_RENORMALISED,
    ),
    FamilyDescription(
        family="olmoe",
        model_types=("olmoe",),
        architectures=("OlmoeForCausalLM",),
        qk_norm="across_heads",
        mlp_variant="moe",
        renormalize_field=_MOE_RENORMALISED,
    ),
    FamilyDescription(
        family="granitemoe",
        model_types=("granitemoe",),
        architectures=("GraniteMoeForCausalLM",),
        mlp_variant="moe",
    ),
    # gpt-oss routes with a biased router (top-k of the logits, softmax over those: the
    # renormalised softmax) and adds a learned sink logit per head.
    FamilyDescription(
        family="gpt_oss",
        model_types=("gpt_oss",),
        architectures=("GptOssForCausalLM",),
        mlp_variant="moe",
        sinks=True,
    ),
    FamilyDescription(
        family="gpt2",
        model_types=("gpt2",),
        architectures=("GPT2LMHeadModel",),
        norm="layernorm",
        positions="learned",
        mlp_variant="dense",
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
    FamilyDescription(
        family="gpt_neo",
        model_types=("gpt_neo",),
        architectures=("GPTNeoForCausalLM",),
        norm="layernorm",
        positions="learned",
        mlp_variant="dense",
        hub_patterns=(r"^EleutherAI/gpt-neo-", r"^roneneldan/TinyStories-"),
        known_models=(
            "EleutherAI/gpt-neo-125m",
            "EleutherAI/gpt-neo-1.3B",
            "EleutherAI/gpt-neo-2.7B",
            "roneneldan/TinyStories-33M",
        ),
    ),
    FamilyDescription(
        family="gptj",
        model_types=("gptj",),
        architectures=("GPTJForCausalLM",),
        norm="layernorm",
        norm_before_mlp=False,
        parallel=True,
        mlp_variant="dense",
        hub_patterns=(r"^EleutherAI/gpt-j-",),
        known_models=("EleutherAI/gpt-j-6b",),
    ),
    # Rotary covers only the first rotary_pct of each head (ModelInfo.rotary_dim).
    FamilyDescription(
        family="gpt_neox",
        model_types=("gpt_neox",),
        architectures=("GPTNeoXForCausalLM",),
        norm="layernorm",
        parallel=True,
        parallel_field="use_parallel_residual",
        mlp_variant="dense",
        hub_patterns=(r"^EleutherAI/pythia-", r"^EleutherAI/gpt-neox-"),
        known_models=(
            "EleutherAI/pythia-70m",
            "EleutherAI/pythia-160m",
            "EleutherAI/pythia-410m",
            "EleutherAI/pythia-1b",
            "EleutherAI/pythia-1.4b",
            "EleutherAI/pythia-2.8b",
            "EleutherAI/pythia-6.9b",
            "EleutherAI/pythia-12b",
            "EleutherAI/pythia-70m-deduped",
            "EleutherAI/gpt-neox-20b",
        ),
    ),
    FamilyDescription(
        family="opt",
        model_types=("opt",),
        architectures=("OPTForCausalLM",),
        norm="layernorm",
        positions="learned",
        mlp_variant="dense",
        config_requires={
            "do_layer_norm_before": (
                True,
                "post-LN OPT (opt-350m) normalises after each sublayer, which the canonical "
                "pre-norm hooks cannot describe",
            ),
            "_remove_final_layer_norm": (False, "the final norm is expected"),
        },
        same_width=(
            "word_embed_proj_dim",
            "OPT's project_in/project_out around the blocks (word_embed_proj_dim != "
            "hidden_size) are not described",
        ),
        hub_patterns=(r"^facebook/opt-",),
        known_models=(
            "facebook/opt-125m",
            "facebook/opt-1.3b",
            "facebook/opt-2.7b",
            "facebook/opt-6.7b",
            "facebook/opt-13b",
        ),
    ),
    FamilyDescription(
        family="bloom",
        model_types=("bloom",),
        architectures=("BloomForCausalLM",),
        norm="layernorm",
        norm_after_embed=True,
        positions="alibi",
        mlp_variant="dense",
        config_requires={
            "apply_residual_connection_post_layernorm": (
                False,
                "with it the residual stream is the normalised input, which the hook "
                "vocabulary's residual hooks cannot express",
            ),
        },
        hub_patterns=(r"^bigscience/bloom", r"^bigscience/bloomz"),
        known_models=(
            "bigscience/bloom-560m",
            "bigscience/bloom-1b1",
            "bigscience/bloom-1b7",
            "bigscience/bloom-3b",
            "bigscience/bloom-7b1",
            "bigscience/bloomz-560m",
        ),
    ),
    # Falcon-7B's layout: one norm feeding attention and the MLP in parallel, multi-query.
    FamilyDescription(
        family="falcon",
        model_types=("falcon",),
        architectures=("FalconForCausalLM",),
        norm="layernorm",
        norm_before_mlp=False,
        parallel=True,
        mlp_variant="dense",
        config_requires={
            "new_decoder_architecture": (
                False,
                "Falcon-40B/180B's grouped fused layout with two norms is not described",
            ),
            "multi_query": (True, "only the multi-query (Falcon-7B) layout is described"),
            "alibi": (False, "Falcon-RW's ALiBi attention is not described"),
            "parallel_attn": (True, "only the parallel attention/MLP block is described"),
        },
        hub_patterns=(r"^tiiuae/falcon-7b",),
        known_models=("tiiuae/falcon-7b", "tiiuae/falcon-7b-instruct"),
    ),
)


def all_families() -> tuple[FamilyDescription, ...]:
    """Every hand-written family description."""
    return FAMILIES


def family_named(name: str) -> FamilyDescription:
    """The description of family ``name`` (``"llama"``).

    Raises:
        KeyError: No family has that name (the message lists them).
    """
    for description in FAMILIES:
        if description.family == name:
            return description
    raise KeyError(
        f"no family description is named {name!r}; described: "
        f"{', '.join(sorted(d.family for d in FAMILIES))}"
    )


def family_description(
    model_type: str | None = None, architectures: tuple[str, ...] | list[str] | None = None
) -> FamilyDescription | None:
    """The description of a checkpoint's family, or ``None`` when nobody wrote one.

    Architecture class names win over ``model_type`` (a ``model_type`` can cover several
    heads).
    """
    for arch in architectures or ():
        for description in FAMILIES:
            if arch in description.architectures:
                return description
    if model_type:
        for description in FAMILIES:
            if model_type in description.model_types:
                return description
    return None
