"""Compatibility mode: HookedTransformer's processed weights, checked against a fold done here.

The expected weights are recomputed in this file from the plain transformers model's state
dict (in float64, in HookedTransformer's [in, out] shapes and in a different order from
the driver: value biases are folded before centring), and the expected activations follow
from what each transformation means: centring writers subtracts the mean over d_model from
the residual stream, folding a norm makes its output its normalized value, folding value
biases removes b_V from the values, and logits move by a per-position constant.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tl_core import TransformerBridge, UnsupportedFeatureError, UserError
from tl_driver_hf import build_bridge_from_module

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "stablelm")
REFUSED = ("mixtral", "gemma2", "gemma3", "olmo2")
ROLES = ("q", "k", "v", "qkv", "o", "pre", "pre_linear", "gate_up", "down")


def _boot(folder: Path, **compat: Any) -> TransformerBridge:
    bridge = TransformerBridge.boot_transformers(str(folder))
    bridge.enable_compatibility_mode(**compat)
    return bridge


def _original(folder: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return {k: v.detach().double() for k, v in model.state_dict().items()}


def _w(sd: dict[str, torch.Tensor], name: str, conv1d: bool) -> torch.Tensor:
    """A projection's weight as [in, out]."""
    return sd[name] if conv1d else sd[name].T


def _expected_fold(
    p: dict[str, Any], sd: dict[str, torch.Tensor], n_heads: int, n_kv: int
) -> dict[str, torch.Tensor]:
    """The processed weights, as [in, out] matrices / bias vectors keyed by HF names."""
    conv1d = p.get("conv1d", False)
    layer_norm = p["norm"] == "layernorm"
    plus_one = p["norm"] == "rms_plus_one"
    out: dict[str, torch.Tensor] = {}

    def norm_params(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = sd[f"{name}.weight"]
        return (w + 1.0 if plus_one else w), sd.get(f"{name}.bias")

    def center_rows(x: torch.Tensor) -> torch.Tensor:  # mean over d_model of [rows, d_model]
        return x - x.mean(-1, keepdim=True) if layer_norm else x

    out[f"{p['embed']}.weight"] = center_rows(sd[f"{p['embed']}.weight"])
    if "pos" in p:
        out[f"{p['pos']}.weight"] = center_rows(sd[f"{p['pos']}.weight"])
    n_layers = 1 + max(
        int(k.split(".")[len(p["layers"].split("."))])
        for k in sd
        if k.startswith(p["layers"] + ".")
    )
    for i in range(n_layers):
        base = f"{p['layers']}.{i}."
        for ln, roles in (
            ("ln1", ("q", "k", "v", "qkv")),
            ("ln2", ("pre", "pre_linear", "gate_up")),
        ):
            w, b = norm_params(base + p[ln])
            for role in roles:
                if role not in p:
                    continue
                name = (
                    f"{base}{p['attn'] if role in ('q', 'k', 'v', 'qkv') else p['mlp']}.{p[role]}"
                )
                W = _w(sd, name + ".weight", conv1d)
                bias = sd.get(name + ".bias", torch.zeros(W.shape[1], dtype=W.dtype))
                if b is not None:
                    bias = bias + b @ W
                W = w[:, None] * W
                if layer_norm:
                    W = W - W.mean(0, keepdim=True)
                out[name + ".weight"], out[name + ".bias"] = W, bias
        # Value biases first (the driver centres first): the two orders must agree.
        o = f"{base}{p['attn']}.{p['o']}"
        W_O = _w(sd, o + ".weight", conv1d)
        b_O = sd.get(o + ".bias", torch.zeros(W_O.shape[1], dtype=W_O.dtype))
        d_head = W_O.shape[0] // n_heads
        if "qkv" in p:
            qkv = f"{base}{p['attn']}.{p['qkv']}"
            b_V = out[qkv + ".bias"][(n_heads + n_kv) * d_head :]
            out[qkv + ".bias"] = torch.cat(
                [out[qkv + ".bias"][: (n_heads + n_kv) * d_head], torch.zeros_like(b_V)]
            )
        else:
            v = f"{base}{p['attn']}.{p['v']}"
            b_V = out[v + ".bias"]
            out[v + ".bias"] = torch.zeros_like(b_V)
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            b_O = b_O + b_V[kv * d_head : (kv + 1) * d_head] @ W_O[h * d_head : (h + 1) * d_head]
        down = f"{base}{p['mlp']}.{p['down']}"
        W_out = _w(sd, down + ".weight", conv1d)
        b_out = sd.get(down + ".bias", torch.zeros(W_out.shape[1], dtype=W_out.dtype))
        out[o + ".weight"], out[o + ".bias"] = center_rows(W_O), center_rows(b_O)
        out[down + ".weight"], out[down + ".bias"] = center_rows(W_out), center_rows(b_out)
        for ln in ("ln1", "ln2"):
            out[f"{base}{p[ln]}.weight"] = torch.full_like(
                sd[f"{base}{p[ln]}.weight"], 0.0 if plus_one else 1.0
            )
    head = p["head"]
    W_U = sd.get(f"{head}.weight", sd[f"{p['embed']}.weight"]).T
    w, b = norm_params(p["final"])
    b_U = b @ W_U if b is not None else torch.zeros(W_U.shape[1], dtype=W_U.dtype)
    W_U = w[:, None] * W_U
    if layer_norm:
        W_U = W_U - W_U.mean(0, keepdim=True)
    out[f"{head}.weight"] = W_U - W_U.mean(1, keepdim=True)
    out[f"{head}.bias"] = b_U - b_U.mean()
    return out


def _zero_if_missing(state: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    return state[name].double() if name in state else torch.zeros_like(like)


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "gemma", "phi3"])
def test_weights_match_an_independent_fold(
    family: str, paths: dict[str, Any], checkpoint: Callable[[str], Path]
) -> None:
    folder = checkpoint(family)
    bridge = _boot(folder)
    info = bridge.cfg
    expected = _expected_fold(paths, _original(folder), info.n_heads, info.kv_heads)
    conv1d = paths.get("conv1d", False)
    got = {k: v.detach().double() for k, v in bridge.driver.hf_model.state_dict().items()}  # type: ignore[attr-defined]
    checked = 0
    for name, want in expected.items():
        is_proj = (
            name.endswith(".weight")
            and want.ndim == 2
            and not name.startswith((paths["embed"], paths.get("pos", "-")))
        )
        have = _zero_if_missing(got, name, want)
        if is_proj:
            have = have if (conv1d and not name.startswith(paths["head"])) else have.T
        torch.testing.assert_close(have, want, atol=2e-6, rtol=1e-5, msg=f"{family}: {name}")
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("family", SUPPORTED)
def test_logits_change_only_by_a_per_position_constant(
    family: str, checkpoint: Callable[[str], Path], ids: torch.Tensor
) -> None:
    folder = checkpoint(family)
    plain = TransformerBridge.boot_transformers(str(folder))
    compat = _boot(folder)
    with torch.no_grad():
        before, after = plain(ids), compat(ids)
    torch.testing.assert_close(after.log_softmax(-1), before.log_softmax(-1), atol=1e-4, rtol=0)
    shift = after - before
    torch.testing.assert_close(
        shift, shift.mean(-1, keepdim=True).expand_as(shift), atol=1e-4, rtol=0
    )
    # Centring the unembedding moves the logits' mean over the vocabulary to zero.
    assert after.mean(-1).abs().max() < 1e-4
    assert before.mean(-1).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["gpt2", "stablelm", "llama", "gemma"])
def test_activations_follow_the_processed_weights(
    family: str, paths: dict[str, Any], checkpoint: Callable[[str], Path], ids: torch.Tensor
) -> None:
    folder = checkpoint(family)
    plain = TransformerBridge.boot_transformers(str(folder))
    compat = _boot(folder)
    with torch.no_grad():
        _, ref = plain.run_with_cache(ids)
        _, got = compat.run_with_cache(ids)
    layer_norm = paths["norm"] == "layernorm"
    n_layers = compat.cfg.n_layers
    resid = ["blocks.0.hook_in"] + [
        f"blocks.{i}.{h}" for i in range(n_layers) for h in ("ln2.hook_in", "hook_out")
    ]
    for name in resid:
        want = ref[name] - ref[name].mean(-1, keepdim=True) if layer_norm else ref[name]
        torch.testing.assert_close(got[name], want, atol=2e-5, rtol=1e-4, msg=name)
        if layer_norm:
            assert got[name].mean(-1).abs().max() < 1e-5, name
    for i in range(n_layers):
        for ln in ("ln1", "ln2"):
            normalized = ref[f"blocks.{i}.{ln}.hook_normalized"].to(
                got[f"blocks.{i}.{ln}.hook_out"].dtype
            )
            torch.testing.assert_close(
                got[f"blocks.{i}.{ln}.hook_out"], normalized, atol=2e-5, rtol=1e-4
            )
            torch.testing.assert_close(
                got[f"blocks.{i}.{ln}.hook_scale"],
                ref[f"blocks.{i}.{ln}.hook_scale"],
                atol=2e-5,
                rtol=1e-4,
            )
        for hook in ("hook_q", "hook_k", "hook_pattern", "hook_pre"):
            name = f"blocks.{i}.{'mlp' if hook == 'hook_pre' else 'attn'}.{hook}"
            torch.testing.assert_close(got[name], ref[name], atol=2e-5, rtol=1e-4, msg=name)
        # The value bias leaves hook_v, including the part the LayerNorm bias folded into it.
        b_V = plain.b_V[i]
        ln1 = plain.driver.hf_model.get_submodule(f"{paths['layers']}.{i}.{paths['ln1']}")  # type: ignore[attr-defined]
        if getattr(ln1, "bias", None) is not None:
            b_V = b_V + torch.einsum("d,hde->he", ln1.bias, plain.W_V[i])
        torch.testing.assert_close(
            got[f"blocks.{i}.attn.hook_v"],
            ref[f"blocks.{i}.attn.hook_v"] - b_V,
            atol=2e-5,
            rtol=1e-4,
        )


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_logits_are_a_hand_forward_of_the_independent_fold(
    family: str, paths: dict[str, Any], checkpoint: Callable[[str], Path], ids: torch.Tensor
) -> None:
    folder = checkpoint(family)
    plain = TransformerBridge.boot_transformers(str(folder))
    compat = _boot(folder)
    expected = _expected_fold(paths, _original(folder), compat.cfg.n_heads, compat.cfg.kv_heads)
    with torch.no_grad():
        _, ref = plain.run_with_cache(ids, names_filter=["ln_final.hook_normalized"])
        logits = compat(ids)
    hand = (
        ref["ln_final.hook_normalized"].double() @ expected[f"{paths['head']}.weight"]
        + expected[f"{paths['head']}.bias"]
    )
    torch.testing.assert_close(logits.double(), hand, atol=1e-4, rtol=1e-4)


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
    with torch.no_grad():
        before, ref = plain.run_with_cache(
            ids, names_filter=["blocks.1.hook_out", "blocks.0.ln1.hook_out"]
        )
        after, got = only_center.run_with_cache(
            ids, names_filter=["blocks.1.hook_out", "blocks.0.ln1.hook_out"]
        )
    torch.testing.assert_close(after, before, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(
        got["blocks.0.ln1.hook_out"], ref["blocks.0.ln1.hook_out"], atol=2e-5, rtol=1e-4
    )
    assert got["blocks.1.hook_out"].mean(-1).abs().max() < 1e-5
    # RMSNorm does not remove the mean, so centring is skipped there and reported as such.
    rms = _boot(checkpoint("llama"))
    assert rms.driver.compatibility_mode.center_writing_weights is False  # type: ignore[attr-defined]
    assert rms.driver.compatibility_mode.fold_ln is True  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", REFUSED)
def test_unimplemented_families_are_refused_by_name(
    family: str, checkpoint: Callable[[str], Path]
) -> None:
    bridge = TransformerBridge.boot_transformers(str(checkpoint(family)))
    before = {k: v.clone() for k, v in bridge.driver.hf_model.state_dict().items()}  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedFeatureError, match=repr(family)):
        bridge.enable_compatibility_mode()
    after = bridge.driver.hf_model.state_dict()  # type: ignore[attr-defined]
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


@pytest.mark.parametrize("family", ["opt", "bloom", "gpt_neo"])
def test_families_without_a_verified_fold_are_refused(family: str, tmp_path: Path) -> None:
    from tl_driver_hf.testing import write_tiny_checkpoint

    folder = write_tiny_checkpoint(family, tmp_path / family)
    bridge = TransformerBridge.boot_transformers(str(folder))
    before = {k: v.clone() for k, v in bridge.driver.module.state_dict().items()}
    with pytest.raises(UnsupportedFeatureError, match=rf"{family!r} family"):
        bridge.enable_compatibility_mode()
    after = bridge.driver.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
