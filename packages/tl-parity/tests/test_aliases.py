"""Alias reports on tiny real checkpoints: every name of every generation, honest statuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tl_driver_hf")

import tl_core
from tl_driver_hf.testing import write_tiny_checkpoint
from tl_parity._aliases import (
    ALIAS_STATUSES,
    GENERATIONS,
    AliasReport,
    alias_report,
    alias_reports,
)

FAMILIES = ("gpt2", "llama", "gemma2", "gpt_neox")

# interp-engine 1.14.3's point list, written out here (not read from tl-core's table) so a
# point the table loses shows up as a failure.
IE_GLOBAL = ("embeddings", "final_norm", "lm_head")
IE_PER_LAYER = (
    "resid_pre", "attn_in", "q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out", "value",
    "attn_scores", "attn_probs", "z", "attn_gate", "attn_out", "attn_out_post", "resid_mid",
    "mlp_in", "mlp_pre", "mlp_pre_linear", "mlp_act", "router_logits", "expert_weights",
    "expert_indices", "mlp_out", "mlp_out_post", "resid_post", "resid_streams",
    "attn_stream_collapse", "mlp_stream_collapse", "attn_stream_write", "attn_stream_mix",
    "mlp_stream_write", "mlp_stream_mix",
)  # fmt: skip

# Rows per status for each (family, generation) of a 2-layer checkpoint on the hf driver.
# A change here means tl-core's alias tables or the driver's served set changed: check
# the new rows are honest, then update. (Encoder-decoders added cross_attn.* and ln3.*, absent
# from these decoder-only models: 22 names of TransformerLens 4.x, 4 of HookedTransformer.)
EXPECTED_COUNTS: dict[tuple[str, str], dict[str, int]] = {
    ("gpt2", "transformer_lens_2"): {"real": 42, "derived": 2, "needs_capture": 8, "structurally_absent": 33},
    ("gpt2", "transformer_lens_4"): {"real": 82, "derived": 4, "needs_capture": 8, "structurally_absent": 148},
    ("gpt2", "nnterp"): {"real": 47, "derived": 1},
    ("gpt2", "interp_engine"): {"real": 33, "structurally_absent": 32},
    ("llama", "transformer_lens_2"): {"real": 47, "derived": 2, "needs_capture": 8, "structurally_absent": 28},
    ("llama", "transformer_lens_4"): {"real": 97, "derived": 5, "needs_capture": 8, "structurally_absent": 132},
    ("llama", "nnterp"): {"real": 45, "derived": 3},
    ("llama", "interp_engine"): {"real": 35, "structurally_absent": 30},
    ("gemma2", "transformer_lens_2"): {"real": 55, "derived": 2, "needs_capture": 8, "structurally_absent": 20},
    ("gemma2", "transformer_lens_4"): {"real": 113, "derived": 5, "needs_capture": 8, "structurally_absent": 116},
    ("gemma2", "nnterp"): {"real": 45, "derived": 3},
    ("gemma2", "interp_engine"): {"real": 35, "structurally_absent": 30},
    ("gpt_neox", "transformer_lens_2"): {"real": 43, "derived": 2, "needs_capture": 8, "structurally_absent": 32},
    ("gpt_neox", "transformer_lens_4"): {"real": 91, "derived": 5, "needs_capture": 8, "structurally_absent": 138},
    ("gpt_neox", "nnterp"): {"real": 45, "derived": 1, "structurally_absent": 2},
    ("gpt_neox", "interp_engine"): {"real": 31, "structurally_absent": 34},
}  # fmt: skip
TOTALS = {"transformer_lens_2": 85, "transformer_lens_4": 242, "nnterp": 48, "interp_engine": 65}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("alias-ckpt")
    return {f: write_tiny_checkpoint(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def bridges(checkpoints: dict[str, Path]) -> dict[str, Any]:
    return {f: tl_core.boot(str(p), driver="hf") for f, p in checkpoints.items()}


@pytest.fixture(scope="module")
def reports(bridges: dict[str, Any]) -> dict[tuple[str, str], AliasReport]:
    return {(f, g): r for f, b in bridges.items() for g, r in alias_reports(b).items()}


@pytest.mark.parametrize(("family", "generation"), sorted(EXPECTED_COUNTS))
def test_counts_per_generation(
    reports: dict[tuple[str, str], AliasReport], family: str, generation: str
) -> None:
    report = reports[family, generation]
    assert len(report.rows) == TOTALS[generation]
    expected = dict.fromkeys(ALIAS_STATUSES, 0) | EXPECTED_COUNTS[family, generation]
    assert report.counts == expected, f"{family}/{generation}: {report.counts}"
    assert sum(report.counts.values()) == len(report.rows)
    assert len({r.name for r in report.rows}) == len(report.rows), "a name is listed twice"


def test_every_row_is_honest(reports: dict[tuple[str, str], AliasReport]) -> None:
    for (family, generation), report in reports.items():
        for row in report.rows:
            where = f"{family}/{generation}/{row.name}"
            assert row.status in ALIAS_STATUSES, where
            if row.status == "structurally_absent":
                assert row.canonical is None and row.reason, where
            elif row.status == "real":
                assert row.canonical is not None, where
            else:
                assert row.reason, f"{where}: a {row.status} row needs a reason"


def test_interp_engine_points_all_listed_on_gpt2(
    reports: dict[tuple[str, str], AliasReport],
) -> None:
    report = reports["gpt2", "interp_engine"]
    expected = [*IE_GLOBAL, *(f"{p}.{i}" for i in range(2) for p in IE_PER_LAYER)]
    assert sorted(r.name for r in report.rows) == sorted(expected)
    rows = report.by_name()
    for layer in range(2):
        for point, words in (
            ("q_norm_in", "normalise queries"),
            ("k_norm_out", "normalise queries"),
            ("attn_gate", "no output gate"),
            ("router_logits", "mixture of experts"),
            ("expert_indices", "mixture of experts"),
            ("mlp_pre_linear", "not gated"),
            ("resid_streams", "hyper-connection"),
            ("mlp_stream_mix", "hyper-connection"),
        ):
            row = rows[f"{point}.{layer}"]
            assert row.status == "structurally_absent", row
            assert words in row.reason, row
        assert rows[f"resid_post.{layer}"].canonical == f"blocks.{layer}.hook_out"
        assert rows[f"resid_mid.{layer}"].status == "real"
        assert rows[f"value.{layer}"].reason  # per-head vs flattened layout noted
    assert rows["embeddings"].status == "real"


def test_opt_in_sites_need_capture(reports: dict[tuple[str, str], AliasReport]) -> None:
    for family in FAMILIES:
        tl2 = reports[family, "transformer_lens_2"].by_name()
        result = tl2["blocks.1.attn.hook_result"]
        assert (result.status, result.canonical) == ("needs_capture", "blocks.1.attn.hook_result")
        assert "use_attn_result=True" in result.reason
        for x in "qkv":
            row = tl2[f"blocks.0.hook_{x}_input"]
            assert row.status == "needs_capture", row
            assert row.canonical == f"blocks.0.attn.hook_{x}_input"
            assert "set_use_split_qkv_input(True)" in row.reason


def test_attn_result_is_real_once_turned_on(checkpoints: dict[str, Path]) -> None:
    bridge = tl_core.boot(str(checkpoints["gpt2"]), driver="hf", use_attn_result=True)
    rows = alias_report(bridge, "transformer_lens_2").by_name()
    assert rows["blocks.0.attn.hook_result"].status == "real"
    assert rows["blocks.0.hook_q_input"].status == "needs_capture"


def test_structural_differences_between_families(
    reports: dict[tuple[str, str], AliasReport],
) -> None:
    def row(family: str, generation: str, name: str) -> Any:
        return reports[family, generation].by_name()[name]

    # Rotary models have no learned positions.
    for family in ("llama", "gemma2", "gpt_neox"):
        absent = row(family, "transformer_lens_2", "hook_pos_embed")
        assert absent.status == "structurally_absent" and "positions" in absent.reason
    assert row("gpt2", "transformer_lens_2", "hook_pos_embed").status == "real"
    # Parallel blocks have no residual between attention and MLP.
    for name, generation in (
        ("blocks.0.hook_resid_mid", "transformer_lens_2"),
        ("layers_mid[1]", "nnterp"),
        ("resid_mid.0", "interp_engine"),
    ):
        absent = row("gpt_neox", generation, name)
        assert absent.status == "structurally_absent", absent
        assert "parallel" in absent.reason
        assert row("gpt2", generation, name).status == "real"
    # ... but hook_mlp_in still means the MLP norm's input there.
    assert row("gpt_neox", "transformer_lens_2", "blocks.0.hook_mlp_in").canonical == (
        "blocks.0.ln2.hook_in"
    )
    # Sandwich norms: the HookedTransformer name reads after the post-attention norm.
    assert row("gemma2", "transformer_lens_2", "blocks.1.hook_attn_out").canonical == (
        "blocks.1.ln1_post.hook_out"
    )
    assert row("llama", "transformer_lens_2", "blocks.1.hook_attn_out").canonical == (
        "blocks.1.attn.hook_out"
    )
    # Gated MLPs: the bridge's mlp.in is the linear branch; GPT-2 has no gate.
    assert row("llama", "transformer_lens_4", "blocks.0.mlp.in.hook_out").canonical == (
        "blocks.0.mlp.hook_pre_linear"
    )
    assert row("gpt2", "transformer_lens_4", "blocks.0.mlp.gate.hook_out").status == (
        "structurally_absent"
    )
    # The rotary module exists only on rotary models.
    assert row("gpt2", "transformer_lens_4", "rotary_emb.hook_in").status == "structurally_absent"
    assert row("gpt2", "transformer_lens_4", "rotary_emb.hook_out").status == "structurally_absent"
    assert row("llama", "transformer_lens_4", "rotary_emb.hook_cos").status == "real"
    assert row("llama", "transformer_lens_4", "rotary_emb.hook_out").status == "derived"
    # Derived names keep the site they are computed from.
    probs = row("llama", "nnterp", "next_token_probs")
    assert (probs.status, probs.canonical) == ("derived", "unembed.hook_out")
    assert row("llama", "nnterp", "mlps_activation[0]").status == "derived"
    assert row("gpt2", "nnterp", "mlps_activation[0]").status == "real"


def test_text_and_dict_forms(reports: dict[tuple[str, str], AliasReport]) -> None:
    report = reports["gpt_neox", "interp_engine"]
    text = str(report)
    assert text.splitlines()[0].startswith(GENERATIONS["interp_engine"])
    assert "GPTNeoXForCausalLM" in text and "structurally_absent 34" in text
    for row in report.rows:
        assert row.name in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["generation"] == "interp_engine" and data["n_layers"] == 2
    assert data["counts"]["real"] == 31
    assert [r["name"] for r in data["rows"]] == [r.name for r in report.rows]


def test_generation_names_and_inputs(bridges: dict[str, Any]) -> None:
    bridge = bridges["gpt2"]
    assert alias_report(bridge, "legacy").generation == "transformer_lens_2"
    assert alias_report(bridge, "tl_bridge").generation == "transformer_lens_4"
    by_namespace = alias_report(bridge.namespace, "nnterp")
    assert by_namespace.rows == alias_report(bridge, "nnterp").rows
    assert list(alias_reports(bridge, ["nnterp", "legacy"])) == ["nnterp", "transformer_lens_2"]
    with pytest.raises(ValueError, match="unknown naming generation 'pyvene'"):
        alias_report(bridge, "pyvene")
    with pytest.raises(TypeError, match="HookNamespace"):
        alias_report(object(), "nnterp")
