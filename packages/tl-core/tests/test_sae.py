"""Sparse dictionaries: validation, activation rules, the sae-lens folder format, splicing.

sae-lens itself is the reference in ``tests-peers/sae_lens``; these tests need only tl-core.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

from tl_core import ConfigError, TransformerBridge, UnsupportedFeatureError, UserError
from tl_core.sae import SparseDictionary, load_dictionary, random_dictionary, splice


def _dictionary(
    d_in: int = 8, d_sae: int = 32, seed: int = 0, **settings_: Any
) -> SparseDictionary:
    return random_dictionary(d_in, d_sae, seed=seed, scale=0.5, **settings_)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"b_enc": torch.zeros(5)}, "b_enc has shape"),
        ({"W_dec": torch.zeros(7, 8)}, "W_dec has 7 rows"),
        ({"architecture": "jumprelu"}, "needs a threshold"),
        ({"architecture": "topk", "k": 0}, "needs 0 < k <= d_sae"),
        ({"architecture": "topk", "k": 33}, "needs 0 < k <= d_sae"),
        ({"architecture": "gated"}, "architecture 'gated' is not one of"),
        ({"normalize_activations": "whitening"}, "normalize_activations 'whitening'"),
        ({"W_skip": torch.zeros(8, 3)}, "W_skip has shape"),
    ],
)
def test_an_inconsistent_dictionary_is_refused_naming_the_problem(
    changes: dict[str, Any], message: str
) -> None:
    base = {
        "W_enc": torch.zeros(8, 32),
        "b_enc": torch.zeros(32),
        "W_dec": torch.zeros(32, 8),
        "b_dec": torch.zeros(8),
    }
    with pytest.raises(ConfigError, match=message):
        SparseDictionary(**{**base, **changes})


def test_a_transcoder_cannot_subtract_b_dec_from_its_input() -> None:
    with pytest.raises(ConfigError, match="a transcoder cannot subtract b_dec"):
        SparseDictionary(torch.zeros(8, 32), torch.zeros(32), torch.zeros(32, 6), torch.zeros(6))
    transcoder = SparseDictionary(
        torch.zeros(8, 32),
        torch.zeros(32),
        torch.zeros(32, 6),
        torch.zeros(6),
        apply_b_dec_to_input=False,
    )
    assert (transcoder.d_in, transcoder.d_sae, transcoder.d_out) == (8, 32, 6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 32))
def test_activation_rules(seed: int, k: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    standard = _dictionary(seed=seed)
    pre = standard.pre_activations(x)
    assert torch.equal(standard.activate(pre), pre.relu())
    jump = _dictionary(seed=seed, architecture="jumprelu")
    acts = jump.activate(jump.pre_activations(x))
    assert jump.threshold is not None
    assert bool(((acts == 0) | (acts > jump.threshold)).all()) and bool((acts >= 0).all())
    topk = _dictionary(seed=seed, architecture="topk", k=k)
    pre = topk.pre_activations(x)
    acts = topk.activate(pre)
    assert bool(((acts != 0).sum(-1) <= k).all())
    kept = pre.topk(k, dim=-1).values.relu()
    torch.testing.assert_close(
        acts.sort(-1, descending=True).values[..., :k], kept.sort(-1, descending=True).values
    )


def _save(folder: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "sae_weights.safetensors"))
    return folder


def test_a_sae_lens_folder_loads_and_reconstructs_as_the_dictionary(tmp_path: Path) -> None:
    d = _dictionary(architecture="jumprelu")
    tensors = {
        "W_enc": d.W_enc,
        "b_enc": d.b_enc,
        "W_dec": d.W_dec,
        "b_dec": d.b_dec,
        "threshold": d.threshold,
    }
    cfg = {
        "d_in": 8,
        "d_sae": 32,
        "architecture": "jumprelu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "metadata": {"hook_name": "blocks.1.hook_in"},
    }
    loaded = load_dictionary(
        _save(tmp_path / "sae", cfg, {k: v for k, v in tensors.items() if v is not None})
    )
    assert loaded.hook_name == "blocks.1.hook_in" and loaded.architecture == "jumprelu"
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded.reconstruct(x), d.reconstruct(x))


def test_bad_folders_are_refused_with_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"has no cfg\.json"):
        load_dictionary(tmp_path)
    d = _dictionary()
    tensors = {"W_enc": d.W_enc, "b_enc": d.b_enc, "W_dec": d.W_dec, "b_dec": d.b_dec}
    with pytest.raises(
        UnsupportedFeatureError, match="architecture 'gated' is not supported by tl"
    ):
        load_dictionary(_save(tmp_path / "gated", {"architecture": "gated"}, tensors))
    with pytest.raises(ConfigError, match="lacks b_dec"):
        load_dictionary(
            _save(tmp_path / "partial", {}, {k: v for k, v in tensors.items() if k != "b_dec"})
        )


@pytest.fixture(scope="module")
def llama() -> TransformerBridge:
    return TransformerBridge.boot_native("llama", n_layers=2, seed=1)


def test_a_splice_replaces_the_activation_with_the_reconstruction(llama: TransformerBridge) -> None:
    ids = torch.randint(0, llama.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    d = _dictionary(d_in=llama.cfg.d_model, d_sae=4 * llama.cfg.d_model)
    plain = llama.forward(ids)
    # The reference: a plain hook that swaps in the reconstruction computed here.
    handles = llama.add_hook("blocks.1.hook_in", lambda x, *, hook: d.reconstruct(x))
    try:
        want = llama.forward(ids)
    finally:
        for handle in handles:
            handle.remove()
    spliced = splice(llama, d, hook_name="blocks.1.hook_in")
    try:
        torch.testing.assert_close(llama.forward(ids), want, rtol=1e-6, atol=1e-6)
    finally:
        spliced.remove()
    assert not torch.allclose(want, plain, atol=1e-3)
    with_error = splice(llama, d, hook_name="blocks.1.hook_in", use_error_term=True)
    try:
        torch.testing.assert_close(llama.forward(ids), plain, rtol=1e-5, atol=1e-5)
    finally:
        with_error.remove()
    torch.testing.assert_close(llama.forward(ids), plain, rtol=0, atol=0)  # removed without a trace


def test_a_splice_is_refused_before_any_forward_when_it_does_not_fit(
    llama: TransformerBridge,
) -> None:
    with pytest.raises(ConfigError, match="names no site"):
        splice(llama, _dictionary(d_in=llama.cfg.d_model))
    with pytest.raises(
        ConfigError, match=r"reads width 8, but 'blocks.1.hook_in' has shape \(64,\)"
    ):
        splice(llama, _dictionary(d_in=8), hook_name="blocks.1.hook_in")
    transcoder = SparseDictionary(
        torch.zeros(8, 32),
        torch.zeros(32),
        torch.zeros(32, 6),
        torch.zeros(6),
        apply_b_dec_to_input=False,
    )
    with pytest.raises(ConfigError, match="names no output site: pass output_hook_name="):
        splice(llama, transcoder, hook_name="blocks.1.hook_in")


def test_the_repr_names_the_shape_and_settings_not_the_weights() -> None:
    text = repr(_dictionary(architecture="topk", k=4, hook_name="blocks.0.hook_resid_post"))
    assert text.startswith(
        "SparseDictionary('topk', d_in=8, d_sae=32, k=4, hook_name='blocks.0.hook_resid_post'"
    )
    assert text.endswith("dtype=float32)") and "tensor" not in text and len(text) < 200
