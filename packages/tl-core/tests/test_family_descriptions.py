"""Family descriptions: the table's integrity, the rules derived from the facts, and facts
tl did not establish (``"unknown"``), down to which hook sites exist."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from tl_core import ModelInfo, canonical_hook_names, resolve_hook_name
from tl_core.architecture import (
    UNKNOWN,
    FamilyDescription,
    StackDescription,
    all_families,
    describe_model,
    family_description,
    family_named,
)
from tl_core.driver_api import HookNamespace

_CONFIG = dict(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=100, max_position_embeddings=32, hidden_act="silu",
    architectures=["ToyForCausalLM"],
)  # fmt: skip


def _config(**changes: Any) -> SimpleNamespace:
    return SimpleNamespace(**{**_CONFIG, **changes})


def _toy(**changes: Any) -> FamilyDescription:
    return FamilyDescription("toy", ("toy",), ("ToyForCausalLM",), **changes)


def test_every_family_is_described_once() -> None:
    families = all_families()
    names = [d.family for d in families]
    assert len(names) == len(set(names))
    for key in ("model_types", "architectures"):
        owned = [k for d in families for k in getattr(d, key)]
        assert len(owned) == len(set(owned)), f"a {key} value belongs to two families"
    for d in families:
        assert family_named(d.family) is d
        assert family_description(d.model_types[0], None) is d
        assert family_description(None, [d.architectures[0]]) is d
    with pytest.raises(KeyError, match="described: "):
        family_named("nope")
    # The class name wins over the model type (a model type can cover several heads).
    assert family_description("gpt2", ["LlamaForCausalLM"]) is family_named("llama")


def test_model_info_follows_the_description() -> None:
    # GPT-NeoX: LayerNorm, parallel per checkpoint, dense MLP, rotary on a quarter.
    neox = family_named("gpt_neox")
    config = _config(use_parallel_residual=False, rotary_pct=0.25, layer_norm_eps=1e-5)
    expected = ModelInfo(
        n_layers=2, d_model=64, n_heads=4, d_head=16, d_mlp=128, d_vocab=100, n_ctx=32,
        n_key_value_heads=2, normalization_type="LN", positional_embedding_type="rotary",
        gated_mlp=False, parallel_attn_mlp=False, rotary_dim=4, act_fn="silu",
        architecture="ToyForCausalLM",
    )  # fmt: skip
    assert neox.model_info(config) == expected
    assert neox.model_info(_config(use_parallel_residual=True)).parallel_attn_mlp
    assert neox.block_form(_config(use_parallel_residual=True)) == "parallel"
    assert neox.block_form(config) == "sequential"
    olmo2 = family_named("olmo2").model_info(_config())
    assert (olmo2.sandwich_norm, olmo2.qk_norm, olmo2.normalization_type) == (True, True, "RMS")
    bloom = family_named("bloom").model_info(_config())
    assert (bloom.embed_norm, bloom.positional_embedding_type) == (True, "none")
    moe = family_named("qwen2_moe").model_info(
        _config(num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=96)
    )
    assert (moe.n_experts, moe.experts_per_token, moe.d_shared_expert) == (8, 2, 96)
    assert not moe.gated_mlp


def test_per_checkpoint_facts_are_read_and_settled() -> None:
    olmoe = family_named("olmoe")
    assert olmoe.renormalizes(_config(norm_topk_prob=True))
    assert not olmoe.renormalizes(_config(norm_topk_prob=False))
    settled = family_named("gpt_neox").settled(_config(use_parallel_residual=False))
    assert settled.parallel is False and settled.parallel_field is None
    assert settled.is_parallel(_config(use_parallel_residual=True)) is False


def test_config_problems_name_field_value_and_reason() -> None:
    opt = family_named("opt")
    assert opt.config_problems(_config(word_embed_proj_dim=64)) == []
    problems = opt.config_problems(_config(do_layer_norm_before=False, word_embed_proj_dim=32))
    assert problems[0].startswith("do_layer_norm_before=False (expected True): post-LN OPT")
    assert problems[1].startswith("word_embed_proj_dim=32 (expected hidden_size=64)")


def test_the_sandwich_rule_needs_a_norm_after_each_sublayer() -> None:
    assert family_named("gemma2").sandwich and family_named("olmo2").sandwich
    assert not family_named("llama").sandwich
    # The hook vocabulary names ln1_post and ln2_post together: one alone is refused.
    with pytest.raises(ValueError, match="a norm after only one sublayer"):
        _toy(norm_after_attn=True)
    with pytest.raises(ValueError, match="a norm after only one sublayer"):
        _toy(norm_after_mlp=True)
    with pytest.raises(ValueError, match="norm=None"):
        _toy(norm=None)
    assert _toy(norm=None, norm_before_attn=False, norm_before_mlp=False).norm is None


def test_a_post_ln_description_names_its_two_norms_and_nothing_else() -> None:
    """BERT's blocks normalise each residual sum: ln1 and ln2 exist, no norm sits before a
    sublayer, and the block form and ModelInfo say so."""
    bert = _toy(
        norm="layernorm", norm_before_attn=False, norm_before_mlp=False, norm_after_residual=True
    )
    assert bert.block_form() == "post_residual_norm"
    assert not any(".ln1." in t or ".ln2." in t for t in bert.absent_templates())
    config = SimpleNamespace(
        num_hidden_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=11
    )
    assert bert.model_info(config).post_residual_norm
    assert not _toy().model_info(config).post_residual_norm
    for wrong in (
        {"norm_before_attn": True},
        {"norm_before_mlp": True},
        {"norm_after_attn": True, "norm_after_mlp": True},
        {"parallel": True},
        {"norm": None},
    ):
        with pytest.raises(ValueError, match="norm_after_residual"):
            dataclasses.replace(bert, **wrong)


def test_absent_templates_follow_from_the_facts() -> None:
    assert family_named("llama").absent_templates() == {}
    olmo2 = family_named("olmo2").absent_templates()
    assert {t for t in olmo2 if ".ln1." in t} == {
        f"blocks.{{i}}.ln1.{s}" for s in ("hook_in", "hook_scale", "hook_normalized", "hook_out")
    }
    # A sequential block without ln2 still has its input (the residual between sublayers).
    assert "blocks.{i}.ln2.hook_in" not in olmo2 and "blocks.{i}.ln2.hook_out" in olmo2
    gptj = family_named("gptj").absent_templates()
    assert set(gptj) == {
        f"blocks.{{i}}.ln2.{s}" for s in ("hook_scale", "hook_normalized", "hook_out")
    }
    assert (
        "one norm per block feeding both attention and the MLP" in gptj["blocks.{i}.ln2.hook_out"]
    )
    bare = _toy(norm=None, norm_before_attn=False, norm_before_mlp=False, parallel=True)
    assert "blocks.{i}.ln2.hook_in" in bare.absent_templates()
    moe = family_named("mixtral").absent_templates()
    assert set(moe) == {
        f"blocks.{{i}}.mlp.{s}" for s in ("hook_pre", "hook_pre_linear", "hook_post")
    }
    assert _toy(blocks="opaque").absent_templates() == {}


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(all_families()), st.booleans())
def test_a_description_travels_as_plain_data(description: FamilyDescription, stack: bool) -> None:
    if stack:
        description = dataclasses.replace(description, stacks=(StackDescription("blocks"),))
    wire = json.loads(json.dumps(description.as_dict()))  # lists for tuples, as msgpack does
    assert FamilyDescription.from_dict(wire) == description


def test_the_architecture_carries_kind_and_stacks() -> None:
    arch = family_named("llama").architecture(
        _config(), family_named("llama").model_info(_config())
    )
    assert arch.kind == "causal_lm" and arch.stacks == (StackDescription("blocks", "causal"),)
    assert arch.facts()["model"] == "causal lm: blocks (causal attention)"


# -- facts nobody established -----------------------------------------------------------


def _opaque_info(**changes: Any) -> ModelInfo:
    return ModelInfo(
        n_layers=2, d_model=64, n_heads=4, d_head=16, d_mlp=128, d_vocab=100, n_ctx=32,
        normalization_type="unknown", positional_embedding_type="unknown", architecture="Opaque",
        **changes,
    )  # fmt: skip


def test_an_unknown_fact_is_said_as_unknown() -> None:
    opaque = _toy(
        norm=UNKNOWN, norm_before_attn=False, norm_before_mlp=False, norm_before_unembed=UNKNOWN,
        positions=UNKNOWN, blocks="opaque", inferred=True,
    )  # fmt: skip
    info = opaque.model_info(_config())
    assert (info.normalization_type, info.positional_embedding_type) == ("unknown", "unknown")
    arch = opaque.architecture(_config(layer_norm_eps=1e-5), info)
    assert (arch.norm.kind, arch.norm.eps, arch.positions, arch.final_norm) == (
        "unknown", None, "unknown", "unknown"
    )  # fmt: skip
    facts = arch.facts()
    assert facts["block"].endswith("norms unknown") and facts["positions"] == "unknown"
    assert "final norm unknown" in facts["unembedding"]
    assert (
        describe_model(_config(), info, norm=None, block="opaque")
        .facts()["block"]
        .endswith("no norms")
    )


def test_no_site_is_served_on_an_unknown_fact() -> None:
    names = set(canonical_hook_names(_opaque_info()))
    assert "ln_final.hook_in" in names  # a norm module's input and output need no weight rule
    assert not any(n.endswith(("hook_scale", "hook_normalized")) for n in names)
    assert "pos_embed.hook_out" not in names
    assert not any("hook_rot_" in n or "hook_cos" in n for n in names)
    known = set(canonical_hook_names(dataclasses.replace(
        _opaque_info(), normalization_type="RMS", positional_embedding_type="rotary"
    )))  # fmt: skip
    assert "ln_final.hook_scale" in known and "blocks.0.attn.hook_rot_q" in known


def test_an_unknown_fact_is_not_called_structurally_absent() -> None:
    info = _opaque_info()
    rot = resolve_hook_name("blocks.0.attn.hook_rot_q", info=info)
    assert rot.status == "canonical"
    cos = resolve_hook_name("blocks.0.attn.hook_cos", info=info)
    assert cos.status != "structurally_absent"
    learned = dataclasses.replace(info, positional_embedding_type="none")
    assert (
        resolve_hook_name("blocks.0.attn.hook_rot_q", info=learned).status == "structurally_absent"
    )
    namespace = HookNamespace.build(info, ["blocks.0.hook_in"], driver="toy")
    assert "may have such a site" in namespace.reasons["ln_final.hook_scale"]
    assert "position scheme" in namespace.reasons["pos_embed.hook_out"]


def test_analysis_refuses_a_norm_tl_did_not_establish() -> None:
    import torch

    from tl_core import ActivationCache, UserError

    stack = torch.zeros(2, 1, 3, 64)
    cache = ActivationCache({"blocks.0.hook_in": torch.zeros(1, 3, 64)}, info=_opaque_info())
    with pytest.raises(UserError, match="did not establish it for 'Opaque'"):
        cache.apply_ln_to_stack(stack, layer=0)
    known = ActivationCache(
        {"blocks.0.ln1.hook_scale": torch.ones(1, 3, 1)},
        info=dataclasses.replace(_opaque_info(), normalization_type="RMS"),
    )
    torch.testing.assert_close(known.apply_ln_to_stack(stack + 2.0, layer=0), stack + 2.0)
