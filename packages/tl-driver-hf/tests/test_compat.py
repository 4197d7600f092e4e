"""Compatibility mode on every family: weights, activations and logits checked independently.

The weights are compared with ``tests/_compat_reference.py``, which recomputes the
processing from the plain state dict and ``PATHS``. The activations are checked against
what each transformation means, on the plain model's own cache: centring the writers
removes the residual stream's mean over d_model, a folded norm outputs its normalized
value, folding value biases removes them (and the norm bias they absorbed) from the
values, and the logits move by a per-position constant, or not at all under soft-capping.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tl_core import ActivationCache, TransformerBridge, UnsupportedFeatureError, UserError
from tl_driver_hf import build_bridge_from_module

_spec = importlib.util.spec_from_file_location(
    "_hf_compat_reference", Path(__file__).with_name("_compat_reference.py")
)
assert _spec is not None and _spec.loader is not None
_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reference)
_paths_spec = importlib.util.spec_from_file_location(
    "_hf_paths", Path(__file__).with_name("_paths.py")
)
assert _paths_spec is not None and _paths_spec.loader is not None
_paths = importlib.util.module_from_spec(_paths_spec)
_paths_spec.loader.exec_module(_paths)
PATHS: dict[str, dict[str, Any]] = _paths.PATHS

ATOL, RTOL = 2e-5, 1e-4


def _boot(folder: Path, **compat: Any) -> TransformerBridge:
    bridge = TransformerBridge.boot_transformers(str(folder))
    bridge.enable_compatibility_mode(**compat)
    return bridge


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().clone() for k, v in model.state_dict().items()}


def _softcap(bridge: TransformerBridge) -> float | None:
    """The final-logit soft-cap of the checkpoint, read from its transformers config."""
    value = getattr(bridge.driver.hf_model.config, "final_logit_softcapping", None)  # type: ignore[attr-defined]
    return float(value) if value else None


def _expected(folder: Path, paths: dict[str, Any], bridge: TransformerBridge) -> dict[str, Any]:
    before = _state(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager"))
    return _reference.expected_processing(  # type: ignore[no-any-return]
        paths,
        before,
        n_heads=bridge.cfg.n_heads,
        n_kv=bridge.cfg.kv_heads,
        center_unembed=_softcap(bridge) is None,
    )


def _check_weights(folder: Path, paths: dict[str, Any]) -> None:
    before = _state(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager"))
    bridge = _boot(folder)
    expected = _expected(folder, paths, bridge)
    after = _state(bridge.driver.hf_model)  # type: ignore[attr-defined]
    for key, (want, orientation) in expected.items():
        assert key in after, f"processing defines {key}, the model has no such tensor"
        got = _reference.in_out(after[key], orientation)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, msg=key)
    # Everything processing does not define is left exactly as it was.
    untouched = [k for k in after if k not in expected]
    assert all(k in before for k in untouched), f"new tensors {set(untouched) - set(before)}"
    for key in untouched:
        torch.testing.assert_close(after[key], before[key], atol=0, rtol=0, msg=key)


def _check_logits(folder: Path, ids: torch.Tensor) -> None:
    plain = TransformerBridge.boot_transformers(str(folder))
    compat = _boot(folder)
    with torch.no_grad():
        before, after = plain(ids), compat(ids)
    torch.testing.assert_close(after.log_softmax(-1), before.log_softmax(-1), atol=1e-4, rtol=0)
    if _softcap(plain) is not None:
        # tanh would not ignore a per-position shift, so the unembedding is not centred.
        torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
        return
    shift = after - before
    torch.testing.assert_close(
        shift, shift.mean(-1, keepdim=True).expand_as(shift), atol=1e-4, rtol=0
    )
    # Centring the unembedding moves the logits' mean over the vocabulary to zero.
    assert after.mean(-1).abs().max() < 1e-4
    assert before.mean(-1).abs().max() > 1e-3


def _check_hand_forward(folder: Path, paths: dict[str, Any], ids: torch.Tensor) -> None:
    """The logits are the plain model's normalized final residual through the expected W_U."""
    plain = TransformerBridge.boot_transformers(str(folder))
    compat = _boot(folder)
    expected = _expected(folder, paths, plain)
    head = paths["head"]
    with torch.no_grad():
        _, ref = plain.run_with_cache(ids, names_filter=["ln_final.hook_normalized"])
        logits = compat(ids)
    W_U = expected[f"{head}.weight"][0]
    b_U = expected[f"{head}.bias"][0] if f"{head}.bias" in expected else 0.0
    hand = ref["ln_final.hook_normalized"].double() @ W_U + b_U
    softcap = _softcap(plain)
    if softcap is not None:
        hand = softcap * torch.tanh(hand / softcap)
    torch.testing.assert_close(logits.double(), hand, atol=1e-4, rtol=1e-4)


def _residual_names(bridge: TransformerBridge) -> list[str]:
    names = [f"blocks.{i}.{h}" for i in range(bridge.cfg.n_layers) for h in ("hook_in", "hook_out")]
    return [n for n in names if n in bridge.namespace]


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(got, want.to(got.dtype), atol=ATOL, rtol=RTOL, msg=name)


def _check_residual(
    got: ActivationCache, ref: ActivationCache, bridge: TransformerBridge, paths: dict[str, Any]
) -> None:
    """Centred writers remove the mean over d_model (LayerNorm models); RMS models are unchanged."""
    layer_norm = paths["norm"] == "layernorm"
    # BLOOM's embedding norm writes the first residual value and is kept: its mean stays.
    kept = ref["embed_ln.hook_out"].mean(-1, keepdim=True) if "embed_norm" in paths else 0.0
    for name in _residual_names(bridge):
        want = ref[name] - ref[name].mean(-1, keepdim=True) + kept if layer_norm else ref[name]
        _close(got[name], want, name)
    for i in range(bridge.cfg.n_layers):
        for name in (f"blocks.{i}.attn.hook_out", f"blocks.{i}.mlp.hook_out"):
            want = ref[name] - ref[name].mean(-1, keepdim=True) if layer_norm else ref[name]
            _close(got[name], want, name)
            if layer_norm:
                assert got[name].mean(-1).abs().max() < 1e-5, name


def _check_norms(
    got: ActivationCache, ref: ActivationCache, bridge: TransformerBridge, paths: dict[str, Any]
) -> None:
    """Folded norms output their normalized value; kept norms are unchanged."""
    folded = ["ln_final"] + [
        f"blocks.{i}.{ln}"
        for i in range(bridge.cfg.n_layers)
        for ln in ("ln1", "ln2")
        if ln in paths
    ]
    for norm in folded:
        _close(got[f"{norm}.hook_out"], ref[f"{norm}.hook_normalized"], norm)
        _close(got[f"{norm}.hook_scale"], ref[f"{norm}.hook_scale"], norm)
    kept = [
        f"blocks.{i}.{ln}.hook_out"
        for i in range(bridge.cfg.n_layers)
        for ln in ("ln1_post", "ln2_post", "attn.q_norm", "attn.k_norm")
        if ln.split(".")[-1] in paths
    ]
    kept += ["embed_ln.hook_out"] if "embed_norm" in paths else []
    for name in kept:
        _close(got[name], ref[name], name)


def _check_attention_and_mlp(
    got: ActivationCache,
    ref: ActivationCache,
    plain: TransformerBridge,
    paths: dict[str, Any],
) -> None:
    """q, k, patterns and MLP pre-activations are unchanged; values lose their bias."""
    hf_model = plain.driver.hf_model  # type: ignore[attr-defined]
    for i in range(plain.cfg.n_layers):
        for name in ("attn.hook_q", "attn.hook_k", "attn.hook_pattern"):
            _close(got[f"blocks.{i}.{name}"], ref[f"blocks.{i}.{name}"], f"blocks.{i}.{name}")
        mlp_sites = (
            ("mlp.hook_router_logits",) if "router" in paths else ("mlp.hook_pre", "mlp.hook_post")
        )
        for name in mlp_sites:
            _close(got[f"blocks.{i}.{name}"], ref[f"blocks.{i}.{name}"], f"blocks.{i}.{name}")
        b_V = plain.b_V[i]
        if "ln1" in paths:
            ln1 = hf_model.get_submodule(f"{paths['layers']}.{i}.{paths['ln1']}")
            if getattr(ln1, "bias", None) is not None:
                b_V = b_V + torch.einsum("d,hde->he", ln1.bias, plain.W_V[i])
        name = f"blocks.{i}.attn.hook_v"
        _close(got[name], ref[name] - b_V, name)


def _check_activations(folder: Path, paths: dict[str, Any], ids: torch.Tensor) -> None:
    plain = TransformerBridge.boot_transformers(str(folder))
    compat = _boot(folder)
    with torch.no_grad():
        _, ref = plain.run_with_cache(ids)
        _, got = compat.run_with_cache(ids)
    _check_residual(got, ref, compat, paths)
    _check_norms(got, ref, compat, paths)
    _check_attention_and_mlp(got, ref, plain, paths)


def test_weights_match_an_independent_fold(
    family: str, paths: dict[str, Any], checkpoint: Callable[[str], Path]
) -> None:
    _check_weights(checkpoint(family), paths)


def test_log_probs_are_unchanged_and_logits_shift_per_position(
    family: str, checkpoint: Callable[[str], Path], ids: torch.Tensor
) -> None:
    _check_logits(checkpoint(family), ids)


def test_activations_follow_the_processed_weights(
    family: str, paths: dict[str, Any], checkpoint: Callable[[str], Path], ids: torch.Tensor
) -> None:
    _check_activations(checkpoint(family), paths, ids)


def test_logits_are_a_hand_forward_of_the_independent_fold(
    family: str, paths: dict[str, Any], checkpoint: Callable[[str], Path], ids: torch.Tensor
) -> None:
    _check_hand_forward(checkpoint(family), paths, ids)


#: Checkpoint variants whose structure changes what compatibility mode does.
VARIANTS = {
    # GPT-NeoX with use_parallel_residual=False: a sequential block, still two norms.
    "gpt_neox_sequential": ("gpt_neox", {"use_parallel_residual": False}),
    # Gemma 3 ships without a final soft-cap; with one, the unembedding stays uncentred.
    "gemma3_softcapped": ("gemma3", {"final_logit_softcapping": 30.0}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_structural_variants_fold_exactly(variant: str, tmp_path: Path, ids: torch.Tensor) -> None:
    from tl_driver_hf.testing import write_tiny_checkpoint

    family, overrides = VARIANTS[variant]
    folder = write_tiny_checkpoint(family, tmp_path / variant, overrides=overrides)
    paths = PATHS[family]
    _check_weights(folder, paths)
    _check_logits(folder, ids)
    _check_activations(folder, paths, ids)
    _check_hand_forward(folder, paths, ids)


@pytest.mark.parametrize("family", ["gpt2", "bloom", "mixtral"])
def test_the_fold_is_the_same_in_small_row_blocks(
    family: str, checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large tensors are processed in row blocks; blocks of 7 rows cut every tensor unevenly."""
    from tl_driver_hf._weights import _folding

    monkeypatch.setattr(_folding, "ROWS", 7)
    _check_weights(checkpoint(family), PATHS[family])


def test_what_was_kept_or_skipped_is_reported(
    checkpoint: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tl_driver_hf"):
        gemma2 = _boot(checkpoint("gemma2")).driver.compatibility_mode  # type: ignore[attr-defined]
    assert gemma2.center_unembed is False
    assert any("final_logit_softcapping=30" in n for n in gemma2.notes)
    assert any("soft-capped" in r.getMessage() for r in caplog.records)
    assert any("post_feedforward_layernorm" in n for n in gemma2.notes)
    assert any("RMSNorm does not remove the mean" in n for n in gemma2.notes)
    olmo2 = _boot(checkpoint("olmo2")).driver.compatibility_mode  # type: ignore[attr-defined]
    assert any("QK-norms" in n for n in olmo2.notes)
    bloom = _boot(checkpoint("bloom")).driver.compatibility_mode  # type: ignore[attr-defined]
    assert bloom.center_writing_weights is True
    assert [n for n in bloom.notes if "word_embeddings_layernorm" in n]
    gpt2 = _boot(checkpoint("gpt2")).driver.compatibility_mode  # type: ignore[attr-defined]
    assert gpt2.notes == ()


def test_options_apply_one_at_a_time(checkpoint: Callable[[str], Path], ids: torch.Tensor) -> None:
    folder = checkpoint("gpt2")
    plain = TransformerBridge.boot_transformers(str(folder))
    only_center = _boot(folder, fold_ln=False, center_unembed=False, fold_value_biases=False)
    state = only_center.driver.compatibility_mode  # type: ignore[attr-defined]
    assert (state.fold_ln, state.center_writing_weights, state.center_unembed) == (
        False,
        True,
        False,
    )
    names = ["blocks.1.hook_out", "blocks.0.ln1.hook_out"]
    with torch.no_grad():
        before, ref = plain.run_with_cache(ids, names_filter=names)
        after, got = only_center.run_with_cache(ids, names_filter=names)
    torch.testing.assert_close(after, before, atol=5e-5, rtol=1e-4)
    _close(got["blocks.0.ln1.hook_out"], ref["blocks.0.ln1.hook_out"], "ln1.hook_out")
    assert got["blocks.1.hook_out"].mean(-1).abs().max() < 1e-5
    # RMSNorm does not remove the mean, so centring is skipped there and reported as such.
    rms = _boot(checkpoint("llama")).driver.compatibility_mode  # type: ignore[attr-defined]
    assert (rms.center_writing_weights, rms.fold_ln) == (False, True)


def test_an_unfoldable_structure_is_refused_with_it_described(
    checkpoint: Callable[[str], Path],
) -> None:
    from tl_driver_hf._weights._compat import enable_compatibility

    bridge = TransformerBridge.boot_transformers(str(checkpoint("mixtral")))
    driver: Any = bridge.driver
    before = _state(driver.hf_model)
    # A LayerNorm mixture of experts: the norm's bias would have to reach every expert.
    layer_norm_moe = dataclasses.replace(
        driver.adapter,
        description=dataclasses.replace(driver.adapter.description, norm="layernorm"),
    )
    with pytest.raises(UnsupportedFeatureError) as error:
        enable_compatibility(
            driver.hf_model,
            driver.module.parts,
            layer_norm_moe,
            n_heads=4,
            n_kv_heads=2,
            d_head=32,
            parallel=False,
        )
    message = str(error.value)
    for part in (
        "'input_layernorm'",
        "'post_attention_layernorm'",
        "mixture-of-experts",
        "every expert",
    ):
        assert part in message, message
    after = _state(driver.hf_model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_user_model_is_never_mutated(checkpoint: Callable[[str], Path]) -> None:
    folder = checkpoint("gpt2")
    model = AutoModelForCausalLM.from_pretrained(folder)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bridge = build_bridge_from_module(model, tokenizer=str(folder))
    with pytest.raises(UserError, match="never mutates"):
        bridge.enable_compatibility_mode()
    assert set(model.state_dict()) == set(before)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_calls_fail_clearly(checkpoint: Callable[[str], Path]) -> None:
    folder = checkpoint("llama")
    bridge = TransformerBridge.boot_transformers(str(folder))
    with pytest.raises(UserError, match="unknown option"):
        bridge.enable_compatibility_mode(fold_layernorm=True)
    with pytest.raises(UserError, match="must be a bool"):
        bridge.enable_compatibility_mode(fold_ln="yes")
    bridge.enable_compatibility_mode()
    with pytest.raises(UserError, match="already enabled"):
        bridge.enable_compatibility_mode()
    meta = TransformerBridge.boot_transformers(str(folder), load_weights=False)
    with pytest.raises(UserError, match="load_weights=False"):
        meta.enable_compatibility_mode()
