"""The hook vocabulary: canonical templates, alias families, statuses and model listings."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from tl_core._errors import ConfigError, HookNameError, UserError
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._resolution import (
    HookResolution,
    block_index,
    canonical_name,
    known_alias_templates,
    layout_of,
    resolve_hook_name,
    suggest_names,
    template_of,
)
from tl_core.hooks._vocabulary import (
    CANONICAL_TEMPLATES,
    LAYOUTS,
    MISSING_BECAUSE,
    HookRequirement,
    HookTemplate,
    canonical_hook_names,
    is_canonical,
    requirement_met,
)

GPT2 = ModelInfo(
    n_layers=3,
    d_model=16,
    n_heads=4,
    d_head=4,
    d_mlp=64,
    d_vocab=50,
    n_ctx=32,
    architecture="gpt2-style",
)
LLAMA = ModelInfo(
    n_layers=2,
    d_model=16,
    n_heads=4,
    d_head=4,
    d_mlp=48,
    d_vocab=50,
    n_ctx=32,
    n_key_value_heads=2,
    normalization_type="RMS",
    positional_embedding_type="rotary",
    gated_mlp=True,
    architecture="llama-style",
)
GEMMA2 = dataclasses.replace(LLAMA, sandwich_norm=True, architecture="gemma2-style")
QWEN3 = dataclasses.replace(LLAMA, qk_norm=True, architecture="qwen3-style")
NEOX = dataclasses.replace(GPT2, parallel_attn_mlp=True, positional_embedding_type="rotary")
NO_NORM = dataclasses.replace(GPT2, normalization_type=None)
PARALLEL_NO_NORM = dataclasses.replace(NEOX, normalization_type=None)
MIXTRAL = dataclasses.replace(LLAMA, gated_mlp=False, n_experts=4, experts_per_token=2)
BLOOM = dataclasses.replace(GPT2, positional_embedding_type="none", embed_norm=True)
QWEN2_MOE = dataclasses.replace(MIXTRAL, d_shared_expert=12)
DEEPSEEK = dataclasses.replace(
    QWEN2_MOE, d_q_latent=24, d_kv_latent=16, architecture="deepseek-style"
)
MAMBA = dataclasses.replace(LLAMA, mixer=True, architecture="mamba-style")
BERT = dataclasses.replace(
    GPT2,
    post_residual_norm=True,
    token_type_embed=True,
    embed_norm=True,
    head_transform=True,
    architecture="bert-style",
)
T5 = dataclasses.replace(
    GPT2,
    normalization_type="RMS",
    positional_embedding_type="none",
    encoder_layers=3,
    cross_attention=True,
    architecture="t5-style",
)

#: Every structural condition a template may name, each with its reason for absent sites.
REQUIREMENTS = {None, *typing.get_args(HookRequirement)}


# --- canonical templates -------------------------------------------------------------------


def test_every_requirement_is_decided_by_structure_and_explained() -> None:
    for requirement in typing.get_args(HookRequirement):
        assert MISSING_BECAUSE[requirement], requirement
        # Some model of the fixtures has the sites and some lacks them; the opt-ins are
        # decided by the caller, not the structure.
        infos = (
            GPT2,
            LLAMA,
            GEMMA2,
            QWEN3,
            NEOX,
            NO_NORM,
            MIXTRAL,
            QWEN2_MOE,
            DEEPSEEK,
            MAMBA,
            BLOOM,
            PARALLEL_NO_NORM,
            BERT,
            T5,
        )
        met = {requirement_met(requirement, info) for info in infos}
        opt_in = requirement in ("attn_result", "split_qkv_input")
        assert met == ({True} if opt_in else {True, False}), requirement
        if opt_in:
            off = {"include_attn_result": False, "include_split_qkv_input": False}
            assert not requirement_met(requirement, GPT2, **off), requirement


def test_templates_are_unique_with_known_layouts_and_requirements() -> None:
    names = [t.template for t in CANONICAL_TEMPLATES]
    assert len(names) == len(set(names))
    for t in CANONICAL_TEMPLATES:
        assert t.layout in LAYOUTS, t
        assert t.requires in REQUIREMENTS, t
        assert t.description.strip(), t
        assert ("{i}" in t.template) == t.template.startswith("blocks.{i}."), t


def test_design_table_and_lead_additions_are_all_canonical() -> None:
    names = {t.template for t in CANONICAL_TEMPLATES}
    expected = {
        "embed.hook_in",
        "embed.hook_out",
        "pos_embed.hook_in",
        "pos_embed.hook_out",
        "blocks.{i}.attn.hook_cos",
        "blocks.{i}.attn.hook_sin",
        "blocks.{i}.hook_in",
        "blocks.{i}.attn.hook_in",
        "blocks.{i}.attn.hook_q",
        "blocks.{i}.attn.hook_k",
        "blocks.{i}.attn.hook_v",
        "blocks.{i}.attn.hook_rot_q",
        "blocks.{i}.attn.hook_rot_k",
        "blocks.{i}.attn.hook_attn_scores",
        "blocks.{i}.attn.hook_pattern",
        "blocks.{i}.attn.hook_z",
        "blocks.{i}.attn.hook_result",
        "blocks.{i}.attn.hook_out",
        "blocks.{i}.ln2.hook_in",
        "blocks.{i}.mlp.hook_in",
        "blocks.{i}.mlp.hook_pre",
        "blocks.{i}.mlp.hook_pre_linear",
        "blocks.{i}.mlp.hook_post",
        "blocks.{i}.mlp.hook_out",
        "blocks.{i}.hook_out",
        "unembed.hook_out",
    }
    for norm in (
        "blocks.{i}.ln1",
        "blocks.{i}.ln1_post",
        "blocks.{i}.ln2_post",
        "ln_final",
        "embed_ln",
    ):
        expected |= {f"{norm}.hook_{s}" for s in ("in", "scale", "normalized", "out")}
    expected |= {f"blocks.{{i}}.ln2.hook_{s}" for s in ("scale", "normalized", "out")}
    # Mixture-of-experts routing, as TransformerLens 4.x serves it.
    expected |= {
        f"blocks.{{i}}.mlp.hook_{s}" for s in ("router_logits", "expert_weights", "expert_indices")
    }
    # A shared expert beside the routed ones (Qwen2-MoE), and the routed experts' sum.
    expected |= {
        f"blocks.{{i}}.mlp.shared_expert.hook_{s}"
        for s in ("pre", "pre_linear", "post", "out", "gate")
    }
    expected.add("blocks.{i}.mlp.experts.hook_out")
    # Multi-head latent attention's compressed latents (DeepSeek-V2/V3).
    expected |= {"blocks.{i}.attn.hook_q_latent", "blocks.{i}.attn.hook_kv_latent"}
    # A state-space mixer in place of attention and MLP (Mamba).
    expected |= {"blocks.{i}.mixer.hook_in", "blocks.{i}.mixer.hook_out"}
    # BERT's token-type (segment) embedding, as TransformerLens 4.3 names it.
    expected |= {"token_type_embed.hook_in", "token_type_embed.hook_out"}
    # A masked LM's head transform before the final norm, as TransformerLens 4.3 names it.
    expected |= {"mlm_head.hook_in", "mlm_head.hook_out"}
    # Per-head q/k/v inputs (opt-in), HookedTransformer's use_split_qkv_input sites.
    expected |= {f"blocks.{{i}}.attn.hook_{x}_input" for x in "qkv"}
    # QK-norm sites, as TransformerLens 4.x names them.
    expected |= {
        f"blocks.{{i}}.attn.{x}_norm.hook_{s}"
        for x in "qk"
        for s in ("in", "scale", "normalized", "out")
    }
    # An encoder-decoder's cross-attention and the decoder's third norm, as TransformerLens 4.3
    # names them.
    expected |= {
        f"blocks.{{i}}.cross_attn.hook_{s}" for s in ("in", "q", "k", "v", "pattern", "z", "out")
    }
    expected |= {f"blocks.{{i}}.ln3.hook_{s}" for s in ("in", "scale", "normalized", "out")}
    assert names == expected


@pytest.mark.parametrize(
    ("template", "layout"),
    [
        ("blocks.{i}.attn.hook_k", "b p h dh"),
        ("blocks.{i}.attn.hook_pattern", "b h q k"),
        ("blocks.{i}.attn.hook_result", "b p h d"),
        ("blocks.{i}.ln1.hook_scale", "b p 1"),
        ("blocks.{i}.attn.q_norm.hook_scale", "b p h 1"),
        ("blocks.{i}.attn.k_norm.hook_normalized", "b p h dh"),
        ("blocks.{i}.attn.hook_cos", "b p r"),
        ("embed.hook_in", "b p"),
        ("ln_final.hook_scale", "b p 1"),
        ("blocks.{i}.mlp.hook_post", "b p dm"),
        ("unembed.hook_out", "b p vocab"),
        ("blocks.{i}.hook_out", "b p d"),
    ],
)
def test_layouts_follow_the_design(template: str, layout: str) -> None:
    assert layout_of(template.replace("{i}", "1")) == layout


@pytest.mark.parametrize("template", CANONICAL_TEMPLATES, ids=lambda t: t.template)
@pytest.mark.parametrize("layer", [0, 7])
def test_every_canonical_name_resolves_to_itself(template: HookTemplate, layer: int) -> None:
    name = template.format(layer)
    resolution = resolve_hook_name(name)
    assert resolution == HookResolution(name, name, "canonical", "canonical", "")
    assert canonical_name(name) == name
    assert is_canonical(name)
    assert template_of(name) is template
    assert layout_of(name) == template.layout
    assert block_index(name) == (layer if template.per_block else None)


def test_format_needs_a_layer_for_block_templates() -> None:
    block = template_of("blocks.0.hook_out")
    assert block.format(4) == "blocks.4.hook_out"
    with pytest.raises(HookNameError, match="block index"):
        block.format()
    with pytest.raises(HookNameError, match="block index"):
        block.format(-1)
    assert template_of("unembed.hook_out").format(9) == "unembed.hook_out"


def test_legacy_field_names_resolve_back_to_their_template() -> None:
    for t in CANONICAL_TEMPLATES:
        if t.legacy is None:
            continue
        legacy = t.legacy.replace("{i}", "2")
        assert canonical_name(legacy) == t.format(2), t.legacy


def test_is_canonical_rejects_aliases_and_junk() -> None:
    for name in [
        "hook_embed",
        "blocks.3.hook_resid_post",
        "resid_post.3",
        "blocks.03.hook_out",
        "blocks.-1.hook_out",
        "blocks.x.hook_out",
        "",
        "blocks.3.hook_outt",
    ]:
        assert not is_canonical(name), name
    assert not is_canonical(3)
    assert not is_canonical(None)


# --- alias families ------------------------------------------------------------------------

LEGACY = [
    ("hook_embed", "embed.hook_out"),
    ("hook_pos_embed", "pos_embed.hook_out"),
    ("blocks.4.hook_resid_pre", "blocks.4.hook_in"),
    ("blocks.4.hook_resid_mid", "blocks.4.ln2.hook_in"),
    ("blocks.4.hook_resid_post", "blocks.4.hook_out"),
    ("blocks.4.hook_attn_out", "blocks.4.attn.hook_out"),
    ("blocks.4.hook_mlp_out", "blocks.4.mlp.hook_out"),
    # TransformerLens fires hook_mlp_in before ln2: the residual, not the MLP's argument.
    ("blocks.4.hook_mlp_in", "blocks.4.ln2.hook_in"),
    ("hook_unembed", "unembed.hook_out"),
]
TL_BRIDGE = [
    ("blocks.1.attn.q.hook_out", "blocks.1.attn.hook_q"),
    ("blocks.1.attn.k.hook_out", "blocks.1.attn.hook_k"),
    ("blocks.1.attn.v.hook_out", "blocks.1.attn.hook_v"),
    ("blocks.1.attn.q.hook_in", "blocks.1.attn.hook_in"),
    ("blocks.1.attn.qkv.hook_in", "blocks.1.attn.hook_in"),
    ("blocks.1.attn.o.hook_in", "blocks.1.attn.hook_z"),
    ("blocks.1.attn.o.hook_out", "blocks.1.attn.hook_out"),
    ("blocks.1.mlp.in.hook_in", "blocks.1.mlp.hook_in"),
    ("blocks.1.mlp.in.hook_out", "blocks.1.mlp.hook_pre"),
    ("blocks.1.mlp.gate.hook_out", "blocks.1.mlp.hook_pre"),
    ("blocks.1.mlp.out.hook_in", "blocks.1.mlp.hook_post"),
    ("blocks.1.mlp.out.hook_out", "blocks.1.mlp.hook_out"),
    ("unembed.hook_in", "ln_final.hook_out"),
]
NNTERP = [
    ("layers_input[2]", "blocks.2.hook_in"),
    ("layers_mid[2]", "blocks.2.ln2.hook_in"),
    ("layers_output[2]", "blocks.2.hook_out"),
    ("attentions_input[2]", "blocks.2.attn.hook_in"),
    ("attentions_norm_output[2]", "blocks.2.ln1.hook_out"),
    ("attentions_output[2]", "blocks.2.attn.hook_out"),
    ("attentions_premix[2]", "blocks.2.attn.hook_z"),
    ("attention_probabilities[2]", "blocks.2.attn.hook_pattern"),
    ("attention_scores[2]", "blocks.2.attn.hook_attn_scores"),
    ("mlps_input[2]", "blocks.2.mlp.hook_in"),
    ("mlps_norm_output[2]", "blocks.2.ln2.hook_out"),
    ("mlps_neurons[2]", "blocks.2.mlp.hook_post"),
    ("mlps_output[2]", "blocks.2.mlp.hook_out"),
    ("token_embeddings", "embed.hook_out"),
    ("embeddings_output", "embed.hook_out"),
    ("embed_tokens", "embed.hook_out"),
    ("ln_final_output", "ln_final.hook_out"),
    ("ln_final.output", "ln_final.hook_out"),
    ("lm_head_output", "unembed.hook_out"),
    ("logits", "unembed.hook_out"),
]
INTERP_ENGINE = [
    ("embeddings", "embed.hook_out"),
    ("resid_pre.5", "blocks.5.hook_in"),
    ("attn_in.5", "blocks.5.attn.hook_in"),
    ("value.5", "blocks.5.attn.hook_v"),
    ("attn_scores.5", "blocks.5.attn.hook_attn_scores"),
    ("attn_probs.5", "blocks.5.attn.hook_pattern"),
    ("z.5", "blocks.5.attn.hook_z"),
    ("attn_out.5", "blocks.5.attn.hook_out"),
    ("attn_out_post.5", "blocks.5.attn.hook_out"),
    ("resid_mid.5", "blocks.5.ln2.hook_in"),
    ("mlp_in.5", "blocks.5.mlp.hook_in"),
    ("mlp_pre.5", "blocks.5.mlp.hook_pre"),
    ("mlp_pre_linear.5", "blocks.5.mlp.hook_pre_linear"),
    ("mlp_act.5", "blocks.5.mlp.hook_post"),
    ("mlp_out.5", "blocks.5.mlp.hook_out"),
    ("resid_post.5", "blocks.5.hook_out"),
    ("final_norm", "ln_final.hook_out"),
    ("lm_head", "unembed.hook_out"),
]


@pytest.mark.parametrize(
    ("family", "name", "expected"),
    [("legacy", n, e) for n, e in LEGACY]
    + [("tl_bridge", n, e) for n, e in TL_BRIDGE]
    + [("nnterp", n, e) for n, e in NNTERP]
    + [("interp_engine", n, e) for n, e in INTERP_ENGINE],
)
def test_alias_families_resolve(family: str, name: str, expected: str) -> None:
    resolution = resolve_hook_name(name)
    assert (resolution.status, resolution.family, resolution.canonical) == (
        "alias",
        family,
        expected,
    )
    assert canonical_name(name) == expected
    assert layout_of(name) == layout_of(expected)
    assert block_index(name) == block_index(expected)


def test_every_alias_target_is_a_canonical_template() -> None:
    templates = {t.template for t in CANONICAL_TEMPLATES}
    families = {"canonical", "legacy", "tl_bridge", "nnterp", "interp_engine"}
    seen: set[str] = set()
    for key, (family, status, target) in known_alias_templates().items():
        assert family in families, key
        seen.add(family)
        # A target is a template, or one concrete canonical site (rotary_emb -> block 0).
        if status in ("canonical", "alias"):
            assert target in templates or is_canonical(target), key
        elif status == "structurally_absent":
            assert target is None, key
        elif target is not None:
            assert target in templates or is_canonical(target), key
        if "{i}" in key:
            assert target is None or "{i}" in target or "{last}" in target, key
    assert seen == families


# --- statuses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "family", "source"),
    [
        ("blocks.3.hook_attn_in", "legacy", "blocks.3.hook_in"),
        ("blocks.3.attn.hook_attn_in", "tl_bridge", "blocks.3.hook_in"),
        ("blocks.3.attn.qkv.hook_out", "tl_bridge", None),
        ("rotary_emb.hook_out", "tl_bridge", "blocks.0.attn.hook_cos"),
        ("next_token_probs", "nnterp", "unembed.hook_out"),
        ("mlps_activation[3]", "nnterp", "blocks.3.mlp.hook_pre"),
    ],
)
def test_derived_names(name: str, family: str, source: str | None) -> None:
    resolution = resolve_hook_name(name)
    assert (resolution.status, resolution.family, resolution.canonical) == (
        "derived",
        family,
        source,
    )
    assert resolution.note
    with pytest.raises(HookNameError, match="derived") as raised:
        canonical_name(name)
    assert resolution.note in str(raised.value)


def test_attention_input_copy_note_names_both_sides_of_the_norm() -> None:
    note = resolve_hook_name("blocks.3.hook_attn_in").note
    assert "blocks.3.hook_in" in note
    assert "blocks.3.attn.hook_in" in note
    assert "set_use_split_qkv_input" in note
    assert "{i}" not in note


def test_per_head_inputs_are_opt_in_canonical_sites() -> None:
    for x in "qkv":
        assert canonical_name(f"blocks.3.hook_{x}_input") == f"blocks.3.attn.hook_{x}_input"
    names = canonical_hook_names(LLAMA)
    assert "blocks.0.attn.hook_q_input" not in names
    split = canonical_hook_names(LLAMA, include_split_qkv_input=True)
    i = split.index("blocks.0.attn.hook_q_input")
    assert split[i : i + 4] == [f"blocks.0.attn.hook_{x}_input" for x in "qkv"] + [
        "blocks.0.attn.hook_in"
    ]


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("attn_gate.4", "blocks.4.attn.hook_in"),
    ],
)
def test_reconstructed_read_only_names(name: str, source: str) -> None:
    resolution = resolve_hook_name(name)
    assert (resolution.status, resolution.canonical) == ("reconstructed_read_only", source)
    with pytest.raises(HookNameError, match="reconstructed, read-only"):
        canonical_name(name)


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("blocks.2.hook_cross_attn_out", "legacy"),
        ("decoder.0.hook_resid_pre", "legacy"),
        ("encoder.1.attn.hook_pattern", "legacy"),
        ("resid_streams.2", "interp_engine"),
        ("attn_stream_mix.2", "interp_engine"),
        ("resid_post.2.stream-1", "interp_engine"),
    ],
)
def test_structurally_absent_names(name: str, family: str) -> None:
    resolution = resolve_hook_name(name)
    assert (resolution.status, resolution.family, resolution.canonical) == (
        "structurally_absent",
        family,
        None,
    )
    with pytest.raises(HookNameError, match="structurally absent"):
        canonical_name(name)
    with pytest.raises(HookNameError):
        layout_of(name)


@pytest.mark.parametrize(
    "name",
    [
        "vision_projector.hook_out",
        "vision_encoder.encoder_layers.0.attn.hook_pattern",
        "vision_encoder.hook_out",
        "vision_blocks.3.hook_in",
    ],
)
def test_vision_tower_names_say_the_tower_is_not_served_yet(name: str) -> None:
    """TransformerLens 4.3's names of a vision-language model's tower and projector are not
    unknown names: the error says what they are and where the image features are."""
    with pytest.raises(HookNameError, match="vision tower or projector") as refused:
        resolve_hook_name(name)
    assert "blocks.0.hook_in at the image positions" in str(refused.value)


# --- resolution against a model -----------------------------------------------------------


@pytest.mark.parametrize(
    ("info", "name", "status", "canonical"),
    [
        (LLAMA, "hook_pos_embed", "structurally_absent", "pos_embed.hook_out"),
        (GPT2, "blocks.1.attn.hook_rot_q", "structurally_absent", "blocks.1.attn.hook_rot_q"),
        (GPT2, "mlp_pre_linear.1", "structurally_absent", "blocks.1.mlp.hook_pre_linear"),
        (NEOX, "blocks.1.hook_resid_mid", "structurally_absent", None),
        (NEOX, "layers_mid[1]", "structurally_absent", None),
        (NEOX, "blocks.1.hook_mlp_in", "alias", "blocks.1.ln2.hook_in"),
        (NEOX, "blocks.1.ln2.hook_in", "canonical", "blocks.1.ln2.hook_in"),
        (PARALLEL_NO_NORM, "blocks.1.ln2.hook_in", "structurally_absent", "blocks.1.ln2.hook_in"),
        (QWEN3, "blocks.1.attn.hook_q_normed", "alias", "blocks.1.attn.q_norm.hook_out"),
        (QWEN3, "k_norm_in.1", "alias", "blocks.1.attn.k_norm.hook_in"),
        (
            LLAMA,
            "blocks.1.attn.q_norm.hook_out",
            "structurally_absent",
            "blocks.1.attn.q_norm.hook_out",
        ),
        (LLAMA, "rotary_emb.hook_sin", "alias", "blocks.0.attn.hook_sin"),
        (GPT2, "rotary_emb.hook_cos", "structurally_absent", "blocks.0.attn.hook_cos"),
        (LLAMA, "pos_embed.hook_in", "structurally_absent", "pos_embed.hook_in"),
        (GPT2, "hook_tokens", "alias", "embed.hook_in"),
        (MIXTRAL, "blocks.1.mlp.gate.hook_out", "alias", "blocks.1.mlp.hook_router_logits"),
        (MIXTRAL, "blocks.1.mlp.gate.hook_in", "alias", "blocks.1.mlp.hook_in"),
        (MIXTRAL, "expert_indices.1", "alias", "blocks.1.mlp.hook_expert_indices"),
        (MIXTRAL, "blocks.1.mlp.router.hook_out", "alias", "blocks.1.mlp.hook_router_logits"),
        (
            MIXTRAL,
            "blocks.1.mlp.router.hook_expert_weights",
            "alias",
            "blocks.1.mlp.hook_expert_weights",
        ),
        (MIXTRAL, "blocks.1.mlp.hook_router_scores", "derived", "blocks.1.mlp.hook_expert_weights"),
        (LLAMA, "blocks.1.mlp.router.hook_in", "structurally_absent", None),
        (LLAMA, "blocks.1.mlp.hook_router_scores", "structurally_absent", None),
        (
            QWEN2_MOE,
            "blocks.1.mlp.shared_expert_gate.hook_out",
            "alias",
            "blocks.1.mlp.shared_expert.hook_gate",
        ),
        (
            QWEN2_MOE,
            "blocks.1.mlp.shared_expert.out.hook_in",
            "alias",
            "blocks.1.mlp.shared_expert.hook_post",
        ),
        (QWEN2_MOE, "blocks.1.mlp.experts.hook_post", "alias", "blocks.1.mlp.experts.hook_out"),
        (MIXTRAL, "blocks.1.mlp.shared_expert.hook_in", "structurally_absent", None),
        (
            MIXTRAL,
            "blocks.1.mlp.shared_expert.hook_out",
            "structurally_absent",
            "blocks.1.mlp.shared_expert.hook_out",
        ),
        (
            LLAMA,
            "blocks.1.mlp.hook_expert_weights",
            "structurally_absent",
            "blocks.1.mlp.hook_expert_weights",
        ),
        (GPT2, "hook_embed", "alias", "embed.hook_out"),
        (BLOOM, "hook_embed", "alias", "embed_ln.hook_out"),
        (GPT2, "embed_ln.hook_out", "structurally_absent", "embed_ln.hook_out"),
        (NEOX, "blocks.1.ln2.hook_normalized", "canonical", "blocks.1.ln2.hook_normalized"),
        (NO_NORM, "blocks.1.ln1.hook_scale", "structurally_absent", "blocks.1.ln1.hook_scale"),
        (NO_NORM, "blocks.1.hook_resid_mid", "alias", "blocks.1.ln2.hook_in"),
        # Post-LN (BERT): HookedEncoder's resid_mid is the sum ln1 normalises; the MLP's input
        # is ln1's output, as TransformerLens 4.3 serves hook_mlp_in there.
        (BERT, "blocks.1.hook_resid_mid", "alias", "blocks.1.ln1.hook_in"),
        (BERT, "blocks.1.hook_mlp_in", "alias", "blocks.1.mlp.hook_in"),
        (BERT, "blocks.1.hook_resid_post", "alias", "blocks.1.hook_out"),
        (GPT2, "blocks.1.hook_mlp_in", "alias", "blocks.1.ln2.hook_in"),
        (NO_NORM, "unembed.hook_in", "alias", "blocks.2.hook_out"),
        (GEMMA2, "blocks.1.hook_attn_out", "alias", "blocks.1.ln1_post.hook_out"),
        (GEMMA2, "mlps_output[1]", "alias", "blocks.1.ln2_post.hook_out"),
        (GEMMA2, "attn_out.1", "alias", "blocks.1.attn.hook_out"),
        (LLAMA, "blocks.1.hook_attn_out", "alias", "blocks.1.attn.hook_out"),
        (LLAMA, "blocks.1.mlp.in.hook_out", "alias", "blocks.1.mlp.hook_pre_linear"),
        (GPT2, "blocks.1.mlp.in.hook_out", "alias", "blocks.1.mlp.hook_pre"),
        (GPT2, "blocks.1.mlp.gate.hook_out", "structurally_absent", None),
        (LLAMA, "attention_queries[1]", "alias", "blocks.1.attn.hook_rot_q"),
        (GPT2, "attention_keys[1]", "alias", "blocks.1.attn.hook_k"),
        (GPT2, "mlps_activation[1]", "alias", "blocks.1.mlp.hook_post"),
        (LLAMA, "mlps_activation[1]", "derived", "blocks.1.mlp.hook_pre"),
        (GPT2, "blocks.1.attn.hook_result", "canonical", "blocks.1.attn.hook_result"),
    ],
)
def test_resolution_per_model(
    info: ModelInfo, name: str, status: str, canonical: str | None
) -> None:
    resolution = resolve_hook_name(name, info=info)
    assert (resolution.status, resolution.canonical) == (status, canonical)
    if status == "structurally_absent":
        assert resolution.note
        with pytest.raises(HookNameError, match="structurally absent"):
            canonical_name(name, info=info)


def test_model_dependent_names_say_so_without_a_model() -> None:
    for name in [
        "blocks.1.hook_attn_out",
        "mlps_output[1]",
        "blocks.1.mlp.in.hook_out",
        "attention_queries[1]",
    ]:
        assert "info=" in resolve_hook_name(name).note, name


def test_absent_canonical_names_agree_with_the_listing() -> None:
    for info in (GPT2, LLAMA, GEMMA2, NEOX, NO_NORM):
        listed = set(
            canonical_hook_names(info, include_attn_result=True, include_split_qkv_input=True)
        )
        for layer in range(info.n_layers):
            for t in CANONICAL_TEMPLATES:
                name = t.format(layer)
                status = resolve_hook_name(name, info=info).status
                assert (status == "canonical") == (name in listed), (info.architecture, name)


def test_block_index_is_range_checked_against_the_model() -> None:
    assert canonical_name("layers_output[1]", info=LLAMA) == "blocks.1.hook_out"
    for name in ["blocks.2.hook_out", "layers_output[2]", "resid_post.9"]:
        with pytest.raises(HookNameError, match="2 blocks"):
            resolve_hook_name(name, info=LLAMA)


# --- listing a model's hooks ---------------------------------------------------------------


def _block(layer: int, *suffixes: str) -> list[str]:
    return [f"blocks.{layer}.{s}" for s in suffixes]


def test_listing_follows_the_structure_of_each_kind_of_model() -> None:
    gpt2 = canonical_hook_names(GPT2)
    # Inputs first: token ids, embeddings, then the learned positions a GPT-2 has.
    assert gpt2[:4] == [
        "embed.hook_in",
        "embed.hook_out",
        "pos_embed.hook_in",
        "pos_embed.hook_out",
    ]
    assert gpt2[-1] == "unembed.hook_out"
    assert not any(
        n.endswith(("rot_q", "rot_k", "hook_cos", "hook_sin", "pre_linear", "hook_result"))
        or "_norm." in n
        for n in gpt2
    )
    llama = canonical_hook_names(LLAMA)
    assert llama[:3] == ["embed.hook_in", "embed.hook_out", "blocks.0.hook_in"]
    # Every block lists the same sites, and nothing in a block belongs to another block.
    for names in (gpt2, llama):
        blocks = [
            [n.split(".", 2)[2] for n in names if n.startswith(f"blocks.{i}.")] for i in range(2)
        ]
        assert blocks[0] == blocks[1]
    for layer in range(LLAMA.n_layers):
        block = [n for n in llama if n.startswith(f"blocks.{layer}.")]
        for hook in ("attn.hook_rot_q", "attn.hook_cos", "mlp.hook_pre_linear"):
            assert f"blocks.{layer}.{hook}" in block
        # the rotary table before the rotation, rotation after the projections
        assert (
            block.index(f"blocks.{layer}.attn.hook_k")
            < block.index(f"blocks.{layer}.attn.hook_cos")
            < block.index(f"blocks.{layer}.attn.hook_rot_q")
            < block.index(f"blocks.{layer}.attn.hook_attn_scores")
        )
        assert (
            block.index(f"blocks.{layer}.mlp.hook_pre")
            < block.index(f"blocks.{layer}.mlp.hook_pre_linear")
            < block.index(f"blocks.{layer}.mlp.hook_post")
        )
    qwen3 = canonical_hook_names(QWEN3)
    block = [n for n in qwen3 if n.startswith("blocks.0.")]
    # QK-norm sits between the projections and the rotation.
    assert (
        block.index("blocks.0.attn.hook_k")
        < block.index("blocks.0.attn.q_norm.hook_in")
        < block.index("blocks.0.attn.k_norm.hook_out")
        < block.index("blocks.0.attn.hook_rot_q")
    )
    assert set(qwen3) - set(llama) == {
        f"blocks.{i}.attn.{x}_norm.hook_{s}"
        for i in range(2)
        for x in "qk"
        for s in ("in", "scale", "normalized", "out")
    }


def test_listing_is_in_forward_order() -> None:
    names = canonical_hook_names(GEMMA2, include_attn_result=True)
    position = {n: i for i, n in enumerate(names)}
    chain = [
        "embed.hook_out",
        "blocks.0.hook_in",
        "blocks.0.ln1.hook_out",
        "blocks.0.attn.hook_z",
        "blocks.0.attn.hook_result",
        "blocks.0.attn.hook_out",
        "blocks.0.ln1_post.hook_out",
        "blocks.0.ln2.hook_in",
        "blocks.0.mlp.hook_in",
        "blocks.0.mlp.hook_out",
        "blocks.0.ln2_post.hook_out",
        "blocks.0.hook_out",
        "blocks.1.hook_in",
        "blocks.1.hook_out",
        "ln_final.hook_in",
        "unembed.hook_out",
    ]
    assert [position[n] for n in chain] == sorted(position[n] for n in chain)


def test_listing_honours_structure() -> None:
    gpt2 = set(canonical_hook_names(GPT2))
    with_result = canonical_hook_names(GPT2, include_attn_result=True)
    assert set(with_result) - gpt2 == {f"blocks.{i}.attn.hook_result" for i in range(3)}

    neox = set(canonical_hook_names(NEOX))
    # A parallel block keeps its MLP norm's input (the block input as that norm reads it).
    assert {f"blocks.{i}.ln2.hook_{s}" for i in range(3) for s in ("in", "out")} <= neox
    assert not any(n.startswith("blocks.0.ln2") for n in canonical_hook_names(PARALLEL_NO_NORM))

    no_norm = set(canonical_hook_names(NO_NORM))
    assert not any(".ln1." in n or "ln_final" in n or "ln2.hook_scale" in n for n in no_norm)
    assert "blocks.0.ln2.hook_in" in no_norm  # the residual between attention and MLP

    gemma = set(canonical_hook_names(GEMMA2)) - set(canonical_hook_names(LLAMA))
    assert gemma == {
        f"blocks.{i}.{norm}.hook_{s}"
        for i in range(2)
        for norm in ("ln1_post", "ln2_post")
        for s in ("in", "scale", "normalized", "out")
    }


def test_listing_returns_a_fresh_list_and_rejects_bad_info() -> None:
    first = canonical_hook_names(GPT2)
    first.clear()
    assert canonical_hook_names(GPT2)
    assert canonical_hook_names(dataclasses.replace(GPT2, n_layers=0))[:4] == [
        "embed.hook_in",
        "embed.hook_out",
        "pos_embed.hook_in",
        "pos_embed.hook_out",
    ]
    with pytest.raises(ConfigError):
        canonical_hook_names("gpt2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="n_layers"):
        canonical_hook_names(dataclasses.replace(GPT2, n_layers=-1))


# --- errors and suggestions ----------------------------------------------------------------


def test_typo_suggests_the_alias_and_its_canonical_name_with_the_layer_kept() -> None:
    with pytest.raises(HookNameError) as raised:
        resolve_hook_name("blocks.3.hook_resid_psot")
    message = str(raised.value)
    assert "'blocks.3.hook_resid_psot'" in message
    assert "Did you mean 'blocks.3.hook_resid_post' (= 'blocks.3.hook_out')" in message
    assert len(re.findall(r"'blocks\.\d+\.[^']*'", message.split("Did you mean")[1])) <= 6
    assert "blocks.0." not in message


@pytest.mark.parametrize(
    ("typo", "wanted"),
    [
        ("blocks.2.attn.hook_patern", "'blocks.2.attn.hook_pattern'"),
        ("hook_embd", "'hook_embed' (= 'embed.hook_out')"),
        ("layers_outputs[4]", "'layers_output[4]' (= 'blocks.4.hook_out')"),
        ("resid_psot.6", "'resid_post.6' (= 'blocks.6.hook_out')"),
    ],
)
def test_typos_in_every_family_get_suggestions(typo: str, wanted: str) -> None:
    with pytest.raises(HookNameError, match="Did you mean") as raised:
        canonical_name(typo)
    assert wanted in str(raised.value)


def test_nonsense_gets_no_suggestions() -> None:
    with pytest.raises(HookNameError) as raised:
        resolve_hook_name("zzzz")
    assert "Did you mean" not in str(raised.value)
    assert isinstance(raised.value, UserError)


@pytest.mark.parametrize("bad", [None, 3, 3.5, b"blocks.0.hook_out", ["blocks.0.hook_out"]])
def test_non_strings_are_rejected(bad: object) -> None:
    with pytest.raises(HookNameError, match="strings"):
        resolve_hook_name(bad)  # type: ignore[arg-type]
    with pytest.raises(HookNameError):
        canonical_name(bad)  # type: ignore[arg-type]
    with pytest.raises(HookNameError):
        layout_of(bad)  # type: ignore[arg-type]


def test_bad_info_is_rejected() -> None:
    with pytest.raises(ConfigError):
        resolve_hook_name("blocks.0.hook_out", info={"n_layers": 2})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name", ["blocks.-1.hook_out", "layers_output[-1]", "resid_post.-2", "blocks.-3.attn.hook_q"]
)
def test_negative_block_index(name: str) -> None:
    with pytest.raises(HookNameError, match="negative block index"):
        resolve_hook_name(name)


@pytest.mark.parametrize(
    ("name", "example"),
    [
        ("blocks.hook_out", "blocks.0.hook_out"),
        ("blocks.attn.hook_q", "blocks.0.attn.hook_q"),
        ("hook_resid_post", "blocks.0.hook_resid_post"),
        ("attn.hook_pattern", "blocks.0.attn.hook_pattern"),
        ("layers_output", "layers_output[0]"),
        ("resid_post", "resid_post.0"),
    ],
)
def test_missing_block_index(name: str, example: str) -> None:
    with pytest.raises(HookNameError, match="needs a block index") as raised:
        resolve_hook_name(name)
    assert repr(example) in str(raised.value)


def test_zero_padded_index_is_refused_with_the_fix() -> None:
    with pytest.raises(HookNameError, match="leading zero") as raised:
        resolve_hook_name("blocks.03.hook_out")
    assert "'blocks.3.hook_out'" in str(raised.value)


@pytest.mark.parametrize("name", ["attn_in.{i}", "blocks.{i}.hook_out", "blocks.{last}.hook_out"])
def test_a_table_row_with_its_placeholder_is_refused_as_a_name(name: str) -> None:
    # 'attn_in.{i}' once matched its own alias row and resolved to 'blocks.{i}.attn.hook_in'.
    for given in (None, GPT2):
        with pytest.raises(HookNameError, match="placeholder in braces") as raised:
            resolve_hook_name(name, info=given)
        assert "{" not in str(raised.value).rsplit("e.g.", 1)[1]


def test_block_index_of_aliases_and_unknown_names() -> None:
    assert block_index("resid_post.5") == 5
    assert block_index("layers_input[0]") == 0
    assert block_index("hook_embed") is None
    assert block_index("resid_streams.7") == 7
    with pytest.raises(HookNameError):
        block_index("blocks.1.nope")


def test_suggest_names_is_case_insensitive_and_bounded() -> None:
    candidates = [
        "blocks.0.hook_out",
        "blocks.0.hook_in",
        "BLOCKS.0.ATTN.HOOK_Q",
        7,
        "embed.hook_out",
    ]
    assert suggest_names("blocks.0.hook_ot", candidates)[0] == "blocks.0.hook_out"  # type: ignore[arg-type]
    assert suggest_names("blocks.0.attn.hook_q", candidates)[0] == "BLOCKS.0.ATTN.HOOK_Q"  # type: ignore[arg-type]
    assert len(suggest_names("blocks.0.hook", candidates, n=1)) == 1  # type: ignore[arg-type]
    assert suggest_names("blocks.0.hook_out", candidates, n=0) == []  # type: ignore[arg-type]
    assert suggest_names("qqqq", candidates) == []  # type: ignore[arg-type]
    assert suggest_names("x", {"x": 1}) == ["x"]


def test_resolution_is_cached_and_immutable() -> None:
    first = resolve_hook_name("layers_output[1]")
    assert resolve_hook_name("layers_output[1]") is first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.canonical = "x"  # type: ignore[misc]
