"""The engine-independent ``Architecture``: block forms, facts read from configs, reports."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, strategies as st

from tl_core import ModelInfo
from tl_core.architecture import Architecture, block_form, describe_model


def _info(**changes: Any) -> ModelInfo:
    base = ModelInfo(
        n_layers=4, d_model=64, n_heads=4, d_head=16, d_mlp=128, d_vocab=100, n_ctx=64,
        n_key_value_heads=2, normalization_type="RMS", positional_embedding_type="rotary",
        gated_mlp=True, act_fn="silu", architecture="TestForCausalLM",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def _describe(config: Any = None, **info: Any) -> Architecture:
    return describe_model(
        config or SimpleNamespace(), _info(**info), norm="rms", block="sequential"
    )


@pytest.mark.parametrize(
    ("parallel", "before_attn", "before_mlp", "after", "form"),
    [
        (False, True, True, False, "sequential"),
        (True, True, True, False, "parallel"),
        (True, True, False, False, "parallel_shared_norm"),
        (False, True, True, True, "sandwich"),
        (False, False, False, True, "post_norm"),
    ],
)
def test_block_form_follows_where_the_norms_sit(
    parallel: bool, before_attn: bool, before_mlp: bool, after: bool, form: str
) -> None:
    got = block_form(
        parallel=parallel,
        norm_before_attn=before_attn,
        norm_before_mlp=before_mlp,
        norms_after=after,
    )
    assert got == form
    assert (
        block_form(
            parallel=parallel,
            norm_before_attn=before_attn,
            norm_before_mlp=before_mlp,
            norms_after=after,
            opaque=True,
        )
        == "opaque"
    )


def test_attention_variant_from_head_counts_and_latents() -> None:
    assert _describe(n_key_value_heads=None).attention.variant == "mha"  # type: ignore[union-attr]
    assert _describe(n_key_value_heads=2).attention.variant == "gqa"  # type: ignore[union-attr]
    assert _describe(n_key_value_heads=1).attention.variant == "mqa"  # type: ignore[union-attr]
    assert _describe(SimpleNamespace(kv_lora_rank=32)).attention.variant == "mla"  # type: ignore[union-attr]


def test_sliding_window_layers_from_layer_types_or_every_layer() -> None:
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    attn = _describe(SimpleNamespace(sliding_window=16, layer_types=types)).attention
    assert attn is not None and (attn.window, attn.windowed_layers) == (16, (0, 2))
    attn = _describe(SimpleNamespace(sliding_window=16)).attention
    assert attn is not None and attn.windowed_layers == (0, 1, 2, 3)
    attn = _describe(SimpleNamespace(sliding_window=16, use_sliding_window=False)).attention
    assert attn is not None and (attn.window, attn.windowed_layers) == (None, ())
    attn = _describe(SimpleNamespace(sliding_window=None)).attention
    assert attn is not None and attn.window is None


def test_mixture_of_experts_facts() -> None:
    config = SimpleNamespace(
        moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1, mlp_only_layers=[3]
    )
    mlp = _describe(config, n_experts=8, experts_per_token=2).mlp
    assert mlp is not None
    assert (mlp.variant, mlp.d_mlp, mlp.n_experts, mlp.experts_per_token) == ("moe", 32, 8, 2)
    assert mlp.d_shared_expert == 64  # two shared experts of width 32 run as one of 64
    assert mlp.dense_layers == (0, 3)
    sparse_step = _describe(
        SimpleNamespace(decoder_sparse_step=2), n_experts=8, experts_per_token=2
    ).mlp
    assert sparse_step is not None and sparse_step.dense_layers == (0, 2)
    assert _describe(n_experts=8, experts_per_token=2, d_shared_expert=48).mlp.d_shared_expert == 48  # type: ignore[union-attr]


def test_positions_norm_eps_softcaps_multipliers_and_tying() -> None:
    config = SimpleNamespace(
        rms_norm_eps=1e-6, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        embedding_multiplier=12.0, residual_multiplier=1.0, tie_word_embeddings=False,
    )  # fmt: skip
    arch = _describe(config, rotary_dim=8)
    assert arch.norm.eps == 1e-6 and arch.logit_softcap == 30.0 and arch.attention.softcap == 50.0  # type: ignore[union-attr]
    assert arch.multipliers == (("embedding_multiplier", 12.0),)  # a multiplier of 1 is no fact
    assert arch.rotary_fraction == 0.5 and not arch.tied_embeddings
    assert (
        _describe(SimpleNamespace(model_type="bloom"), positional_embedding_type="none").positions
        == "alibi"
    )
    assert _describe(positional_embedding_type="none").positions == "none"
    assert _describe(positional_embedding_type="standard").positions == "learned"
    assert _describe(positional_embedding_type="standard").rotary_fraction is None


def test_an_opaque_block_has_no_attention_or_mlp() -> None:
    arch = describe_model(SimpleNamespace(), _info(), norm="rms", block="opaque")
    assert arch.attention is None and arch.mlp is None
    assert set(arch.facts()) == {"model", "block", "embedding", "positions", "unembedding"}
    assert arch.facts()["model"] == "causal lm: blocks (causal attention)"


def test_the_report_lines_say_every_fact() -> None:
    types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    config = SimpleNamespace(
        rms_norm_eps=1e-5,
        sliding_window=8,
        layer_types=types,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    )
    facts = describe_model(
        config,
        _info(n_experts=4, experts_per_token=2, qk_norm=True),
        norm="rms",
        block="sequential",
        qk_norm="per_head",
        sinks=True,
    ).facts()
    assert facts["block"] == "sequential (4 blocks, d_model 64), rms norms (eps 1e-05)"
    assert (
        facts["attention"]
        == "gqa, 4 heads / 2 key-value, d_head 16, qk-norm per head, window 8 on layers 0-2, sinks"
    )
    assert facts["mlp"] == "moe, d_mlp 32, silu, top 2 of 4 experts, dense on layers 0"
    assert facts["unembedding"] == "tied to the embedding"


def test_differences_name_each_disagreeing_fact() -> None:
    a = _describe(SimpleNamespace(rms_norm_eps=1e-6))
    assert a.differences(a) == []
    b = dataclasses.replace(
        a, block="parallel", attention=dataclasses.replace(a.attention, sinks=True)
    )  # type: ignore[type-var]
    assert a.differences(b) == [
        "block: 'sequential' != 'parallel'",
        "attention.sinks: False != True",
    ]


@given(st.sets(st.integers(min_value=0, max_value=40), min_size=1))
def test_windowed_layers_are_listed_as_runs(layers: set[int]) -> None:
    n = max(layers) + 1
    types = ["sliding_attention" if i in layers else "full_attention" for i in range(n)]
    arch = describe_model(
        SimpleNamespace(sliding_window=4, layer_types=types),
        _info(n_layers=n),
        norm="rms",
        block="sequential",
    )
    assert arch.attention is not None and arch.attention.windowed_layers == tuple(sorted(layers))
    listed = arch.facts()["attention"].split(" on layers ")[1]
    expanded: set[int] = set()
    for part in listed.split(", "):
        start, _, end = part.partition("-")
        expanded.update(range(int(start), int(end or start) + 1))
    assert expanded == layers
