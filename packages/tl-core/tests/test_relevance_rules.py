"""Relevance rules on the native driver, checked against closed forms computed here.

RelP (Relevance Patching) estimates the effect of patching a node ``x`` from clean to
corrupt as ``(x_corrupt - x_clean) . grad~_x m``, where ``grad~`` is the gradient of the
metric with LRP propagation rules in place of the chain rule at three kinds of layers:

* LN-rule, ``y = (x - mean x) / sigma`` with ``sigma`` held constant (RMSNorm: no centring):
  ``grad~_x = (I - 1 1^T / d) grad_y / sigma``. Relevance is conserved per position:
  ``sum_i x_i grad~_x_i = sum_i y_i grad_y_i`` (the plain gradient gives ~0 instead, LayerNorm
  being scale invariant).
* Identity-rule, ``y = f(x)`` for GELU/SiLU: ``grad~_x = grad_y * f(x) / x`` (``1/2`` at
  ``x = 0``, the limit of ``f(x)/x``), so ``x grad~_x = y grad_y`` element by element.
* Half-rule, ``y = a * b`` (gated MLP): ``grad~_a = b grad_y / 2``, ``grad~_b = a grad_y / 2``,
  so ``a grad~_a = b grad~_b = y grad_y / 2``.
* Attention (AH-rule): the attention probabilities ``A`` are constants:
  ``grad~_v = A^T grad_z``, and nothing reaches scores, q or k; ``sum v grad~_v = sum z grad_z``.

Every expected value below is built from captured forward values and upstream gradients
with plain torch, independently of ``tl_core.analysis``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tl_core import TransformerBridge, UnsupportedFeatureError, UserError
from tl_core.analysis import RelevanceRules, use_relevance_rules

Hook = tuple[Any, Callable[..., Any]]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def boot(preset: str, **overrides: Any) -> TransformerBridge:
    return TransformerBridge.boot_native(preset, n_layers=2, d_model=32, d_mlp=64, **overrides)


IDS = torch.tensor([[3, 71, 104, 9, 250, 66, 12], [5, 200, 33, 47, 180, 2, 99]])


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].log_softmax(-1)[:, 7].sum() + logits[:, 2, 11].sum()


def trace(
    bridge: TransformerBridge, names: Sequence[str], edits: Sequence[Hook] = ()
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Logits, then the values and gradients at ``names`` (a gradient only where one came)."""
    values: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, hook: Any) -> None:
        values[hook.name] = x.detach().clone()

    def keep_grad(g: torch.Tensor, hook: Any) -> None:
        grads[hook.name] = g.detach().clone()

    with bridge.hooks([*edits, *((n, keep) for n in names)], [(n, keep_grad) for n in names]):
        logits = bridge(IDS)
        metric(logits).backward()
    return logits.detach(), values, grads


def input_grad(bridge: TransformerBridge) -> torch.Tensor:
    """The metric's gradient at block 0's input: touched by every rule downstream."""
    return trace(bridge, ["blocks.0.hook_in"])[2]["blocks.0.hook_in"]


def hook_count(bridge: TransformerBridge) -> int:
    return sum(p.has_hooks for p in bridge.hook_dict.values())


def read(x: torch.Tensor, hook: Any) -> None:
    return None


def expected_sites(bridge: TransformerBridge) -> dict[str, str]:
    """The rule at each site, from ModelInfo alone (pre-norm models without QK-norm)."""
    info = bridge.cfg
    mlp = "Identity+Half" if info.gated_mlp else "Identity"
    sites: dict[str, str] = {}
    for i in range(info.n_layers):
        sites[f"blocks.{i}.ln1.hook_normalized"] = "LN"
        sites[f"blocks.{i}.attn.hook_pattern"] = "attention"
        sites[f"blocks.{i}.ln2.hook_normalized"] = "LN"
        sites[f"blocks.{i}.mlp.hook_post"] = mlp
    sites["ln_final.hook_normalized"] = "LN"
    return sites


# -- structure and forward ------------------------------------------------------------


@pytest.mark.parametrize(("preset", "act"), [("gpt2", "gelu"), ("llama", "silu")])
def test_model_info_reports_the_activation(preset: str, act: str) -> None:
    assert boot(preset).cfg.act_fn == act
    assert boot(preset, act_fn="gelu_new").cfg.act_fn == "gelu_new"


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_forward_is_bit_identical(preset: str) -> None:
    bridge = boot(preset)
    plain = bridge(IDS)
    with use_relevance_rules(bridge):
        assert torch.equal(bridge(IDS), plain)
        with torch.no_grad():
            assert torch.equal(bridge(IDS), plain)
    with use_relevance_rules(bridge, RelevanceRules(attention=False)):
        assert torch.equal(bridge(IDS), plain)
    assert torch.equal(bridge(IDS), plain)


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_coverage_is_exact_and_printable(preset: str) -> None:
    bridge = boot(preset)
    with use_relevance_rules(bridge) as coverage:
        assert coverage.installed == expected_sites(bridge)
        assert coverage.skipped == {}
        reads = {s.site: s.reads for s in coverage.sites}
        assert reads["ln_final.hook_normalized"] == ("ln_final.hook_in", "ln_final.hook_scale")
        gated = ("blocks.1.mlp.hook_pre", "blocks.1.mlp.hook_pre_linear")
        assert reads["blocks.1.mlp.hook_post"] == (gated if preset == "llama" else gated[:1])
        table = str(coverage)
        assert table.splitlines()[0].endswith("9 installed, 0 skipped")
        assert all(site in table for site in expected_sites(bridge))
    with use_relevance_rules(bridge, RelevanceRules(normalization=False, attention=False)) as cov:
        assert set(cov.installed) == {"blocks.0.mlp.hook_post", "blocks.1.mlp.hook_post"}
        assert cov.skipped["ln_final.hook_normalized"] == "normalization rule off"
        assert cov.skipped["blocks.1.attn.hook_pattern"] == "attention rule off"
        assert "skipped    normalization rule off" in str(cov)


# -- each rule against its closed form ------------------------------------------------


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_ln_rule_treats_the_scale_as_constant(preset: str) -> None:
    bridge = boot(preset)
    centre = bridge.cfg.normalization_type == "LN"
    names = [
        "ln_final.hook_in", "ln_final.hook_scale", "ln_final.hook_normalized",
        "blocks.1.ln2.hook_in", "blocks.1.ln2.hook_scale", "blocks.1.ln2.hook_normalized",
        "blocks.1.hook_out",
    ]  # fmt: skip
    _, plain_values, plain = trace(bridge, names)
    # Attention off keeps the fused attention path, so values match the plain run's bits.
    with use_relevance_rules(bridge, RelevanceRules(attention=False)):
        _, values, grads = trace(bridge, names)

    def rule(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (g - g.mean(-1, keepdim=True) if centre else g) / scale

    for p in ("ln_final.", "blocks.1.ln2."):
        assert torch.equal(values[p + "hook_normalized"], plain_values[p + "hook_normalized"])
        assert p + "hook_scale" not in grads  # the divisor is a constant: no gradient reaches it
    g, s = grads["ln_final.hook_normalized"], values["ln_final.hook_scale"]
    # ln_final's input feeds nothing else, so its gradient is the norm's alone.
    torch.testing.assert_close(grads["ln_final.hook_in"], rule(g, s), rtol=1e-5, atol=1e-7)
    # ln2's input is the residual stream mid-block: the residual path adds hook_out's gradient.
    g, s = grads["blocks.1.ln2.hook_normalized"], values["blocks.1.ln2.hook_scale"]
    expected = grads["blocks.1.hook_out"] + rule(g, s)
    torch.testing.assert_close(grads["blocks.1.ln2.hook_in"], expected, rtol=1e-5, atol=1e-7)
    # RelP's conservation across the norm; the plain gradient breaks it.
    x, y = values["ln_final.hook_in"], values["ln_final.hook_normalized"]
    out_relevance = (y * grads["ln_final.hook_normalized"]).sum(-1)
    torch.testing.assert_close(
        (x * grads["ln_final.hook_in"]).sum(-1), out_relevance, rtol=1e-4, atol=1e-6
    )
    assert not torch.allclose((x * plain["ln_final.hook_in"]).sum(-1), out_relevance, atol=1e-3)


def zero_some(x: torch.Tensor, hook: Any) -> torch.Tensor:
    """Make every third pre-activation exactly 0 (an edit of a site the rule only reads)."""
    mask = torch.zeros(x.shape[-1], dtype=torch.bool)
    mask[::3] = True
    return torch.where(mask, torch.zeros_like(x), x)


def test_identity_rule_multiplies_by_f_over_x_and_half_at_zero() -> None:
    bridge = boot("gpt2")
    p = "blocks.0.mlp."
    edits = [(p + "hook_pre", zero_some)]
    with use_relevance_rules(bridge, RelevanceRules(normalization=False, attention=False)):
        _, values, grads = trace(bridge, [p + "hook_pre", p + "hook_post"], edits)
    pre, post = values[p + "hook_pre"], values[p + "hook_post"]
    g_pre, g_post = grads[p + "hook_pre"], grads[p + "hook_post"]
    zero = pre == 0
    assert int(zero.sum()) == zero[..., ::3].numel()
    assert torch.equal(post, F.gelu(pre))  # the site really is gelu(hook_pre)
    assert torch.equal(g_pre[zero], 0.5 * g_post[zero])
    ratio = torch.where(zero, torch.full_like(pre, 0.5), F.gelu(pre) / pre)
    torch.testing.assert_close(g_pre, g_post * ratio, rtol=1e-5, atol=1e-8)
    # Relevance passes through unchanged (x grad~_x = y grad_y), unlike the plain gradient.
    torch.testing.assert_close((pre * g_pre)[~zero], (post * g_post)[~zero], rtol=1e-5, atol=1e-8)
    _, _, plain = trace(bridge, [p + "hook_pre"], edits)
    assert not torch.allclose(plain[p + "hook_pre"], g_pre, atol=1e-6)


@pytest.mark.parametrize(
    "rules",
    [RelevanceRules(), RelevanceRules(activation=False), RelevanceRules(multiplicative_gate=False)],
    ids=["identity+half", "half", "identity"],
)
def test_gated_mlp_rules_split_the_product(rules: RelevanceRules) -> None:
    bridge = boot("llama")
    p = "blocks.1.mlp."
    names = [p + "hook_pre", p + "hook_pre_linear", p + "hook_post"]
    with use_relevance_rules(bridge, rules) as coverage:
        _, values, grads = trace(bridge, names, [(p + "hook_pre", zero_some)])
    assert coverage.installed[p + "hook_post"] == (
        "Identity+Half" if rules.activation and rules.multiplicative_gate
        else "Half" if rules.multiplicative_gate else "Identity"
    )  # fmt: skip
    pre, up = values[p + "hook_pre"], values[p + "hook_pre_linear"]
    g = grads[p + "hook_post"]
    torch.testing.assert_close(values[p + "hook_post"], F.silu(pre) * up, rtol=0, atol=0)
    share = 0.5 if rules.multiplicative_gate else 1.0
    if rules.activation:
        act_grad = torch.where(pre == 0, torch.full_like(pre, 0.5), F.silu(pre) / pre)
    else:
        x = pre.clone().requires_grad_()
        (act_grad,) = torch.autograd.grad(F.silu(x).sum(), x)
    torch.testing.assert_close(
        grads[p + "hook_pre"], share * up * g * act_grad, rtol=1e-5, atol=1e-8
    )
    torch.testing.assert_close(
        grads[p + "hook_pre_linear"], share * F.silu(pre) * g, rtol=1e-5, atol=1e-8
    )
    if rules.activation and rules.multiplicative_gate:
        # Each factor carries half the product's relevance (Half-rule after Identity-rule).
        half = 0.5 * values[p + "hook_post"] * g
        torch.testing.assert_close(pre * grads[p + "hook_pre"], half, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(up * grads[p + "hook_pre_linear"], half, rtol=1e-5, atol=1e-8)


def test_attention_rule_holds_the_pattern_constant() -> None:
    bridge = boot("gpt2")
    a = "blocks.1.attn."
    names = [
        a + n for n in ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")
    ]
    with use_relevance_rules(bridge, RelevanceRules(normalization=False, activation=False)):
        _, values, grads = trace(bridge, names)
    for silent in ("hook_q", "hook_k", "hook_attn_scores"):
        assert a + silent not in grads, f"{silent} got a gradient through the pattern"
    for block in bridge.blocks:
        assert block.attn.W_Q.grad is None and block.attn.W_K.grad is None
    pattern, v, g_z = values[a + "hook_pattern"], values[a + "hook_v"], grads[a + "hook_z"]
    expected_v = torch.einsum("bhqk,bqhe->bkhe", pattern, g_z)
    torch.testing.assert_close(grads[a + "hook_v"], expected_v, rtol=1e-5, atol=1e-8)
    # The pattern still receives its own gradient (backward hooks there keep working).
    torch.testing.assert_close(
        grads[a + "hook_pattern"], torch.einsum("bqhe,bkhe->bhqk", g_z, v), rtol=1e-5, atol=1e-8
    )
    torch.testing.assert_close(
        (v * grads[a + "hook_v"]).sum(), (values[a + "hook_z"] * g_z).sum(), rtol=1e-5, atol=1e-7
    )


# -- scope: exit, exceptions, nesting, edits ------------------------------------------


def test_rules_are_removed_on_exit_and_on_exception() -> None:
    bridge = boot("llama")
    plain = input_grad(bridge)
    with use_relevance_rules(bridge):
        ruled = input_grad(bridge)
    assert not torch.allclose(ruled, plain, atol=1e-6)
    assert torch.equal(input_grad(bridge), plain) and hook_count(bridge) == 0
    with pytest.raises(RuntimeError, match="boom"), use_relevance_rules(bridge):
        bridge(IDS)
        raise RuntimeError("boom")
    assert torch.equal(input_grad(bridge), plain) and hook_count(bridge) == 0
    assert all(p.edit_refusal is None for p in bridge.hook_dict.values())


def test_nested_scopes_are_reference_counted() -> None:
    bridge = boot("llama")
    plain = input_grad(bridge)
    with use_relevance_rules(bridge) as outer:
        ruled = input_grad(bridge)
        installed = hook_count(bridge)
        with use_relevance_rules(bridge) as inner:
            assert inner == outer and hook_count(bridge) == installed
            assert torch.equal(input_grad(bridge), ruled)
        assert torch.equal(input_grad(bridge), ruled)  # the inner exit removed nothing
        with pytest.raises(UserError, match=r"enclosing.*attn\.hook_pattern"):
            with use_relevance_rules(bridge, RelevanceRules(attention=False)):
                pass
        assert torch.equal(input_grad(bridge), ruled) and hook_count(bridge) == installed
    assert torch.equal(input_grad(bridge), plain) and hook_count(bridge) == 0


def test_edits_of_a_ruled_site_are_refused_while_active() -> None:
    bridge = boot("gpt2")
    double = ("blocks.0.ln1.hook_normalized", lambda x, hook: x * 2)
    halve = {"blocks.0.attn.hook_pattern": {"op": "scale", "factor": 0.5}}
    with use_relevance_rules(bridge):
        with pytest.raises(
            UserError, match=r"'blocks\.0\.ln1\.hook_normalized' cannot be edited now"
        ):
            bridge.run_with_hooks(IDS, fwd_hooks=[double])
        with pytest.raises(UserError, match="cannot be edited now"):
            bridge(IDS, intervene=halve)
        # Reading stays allowed, and so do edits of the values a rule reads.
        _, cache = bridge.run_with_cache(IDS)
        assert "blocks.0.ln1.hook_normalized" in cache
        bridge.run_with_hooks(IDS, fwd_hooks=[("blocks.0.ln1.hook_in", lambda x, hook: x * 2)])
        # A user hook prepended at a ruled site still runs after the rule and sees the
        # value the gradient flows through; resetting hooks leaves the rules alone.
        seen: list[bool] = []
        point = bridge.hook_dict["blocks.0.mlp.hook_post"]
        point.add_hook(lambda x, hook: seen.append(x.grad_fn is not None), prepend=True)
        bridge(IDS)
        bridge.reset_hooks(including_permanent=True)
        assert seen == [True] and point.has_hooks
    edited = bridge.run_with_hooks(IDS, fwd_hooks=[double])
    assert not torch.equal(edited, bridge(IDS))
    bridge(IDS, intervene=halve)


def test_value_preserving_probes_at_a_ruled_site_see_the_ruled_gradient() -> None:
    """Attribution patching's probe (``x + zeros``) changes no value, so it is no edit."""
    bridge = boot("gpt2")
    site = "blocks.1.mlp.hook_post"
    zeros: list[torch.Tensor] = []

    def probe(x: torch.Tensor, hook: Any) -> torch.Tensor:
        zeros.append(torch.zeros_like(x, requires_grad=True))
        return x + zeros[-1]

    with use_relevance_rules(bridge):
        _, _, grads = trace(bridge, ["blocks.1.mlp.hook_pre", site], [(site, probe)])
        ruled = input_grad(bridge)
    torch.testing.assert_close(zeros[0].grad, grads[site], rtol=0, atol=0)
    pre = trace(bridge, ["blocks.1.mlp.hook_pre"])[1]["blocks.1.mlp.hook_pre"]
    ratio = torch.where(pre == 0, torch.full_like(pre, 0.5), F.gelu(pre) / pre)
    torch.testing.assert_close(
        grads["blocks.1.mlp.hook_pre"], grads[site] * ratio, rtol=1e-5, atol=1e-8
    )
    assert not torch.allclose(ruled, input_grad(bridge), atol=1e-6)


def test_a_site_that_stops_reaching_the_model_mid_scope_is_refused() -> None:
    bridge = boot("gpt2")
    with use_relevance_rules(bridge):
        bridge.set_use_split_qkv_input(True)  # attention now reads per-head copies, not ln1
        try:
            with pytest.raises(
                UnsupportedFeatureError, match=r"'blocks\.0\.ln1\.hook_normalized'.*no longer reads"
            ):
                bridge(IDS)
            with torch.no_grad():
                bridge(IDS)  # no gradient, nothing to reach
        finally:
            bridge.set_use_split_qkv_input(False)
        bridge(IDS)


# -- refusals before any pass ---------------------------------------------------------


class _Reporting:
    """A bridge whose driver reports another activation (the rest is the real bridge's)."""

    def __init__(self, bridge: TransformerBridge, act_fn: str | None) -> None:
        self.driver, self.hook_dict, self.namespace = (
            bridge.driver,
            bridge.hook_dict,
            bridge.namespace,
        )
        self.cfg = replace(bridge.cfg, act_fn=act_fn)


def test_relu_and_unknown_activations_are_refused_before_installing() -> None:
    relu = boot("gpt2", act_fn="relu")
    with pytest.raises(
        UnsupportedFeatureError, match=r"'relu'.*RelevanceRules\(activation=False\)"
    ):
        with use_relevance_rules(relu):
            pass
    assert hook_count(relu) == 0
    with use_relevance_rules(relu, RelevanceRules(activation=False)) as coverage:
        assert coverage.skipped == {
            "blocks.0.mlp.hook_post": "activation rule off",
            "blocks.1.mlp.hook_post": "activation rule off",
        }
    gated_relu = boot("llama", act_fn="relu")
    with use_relevance_rules(gated_relu, RelevanceRules(activation=False)) as coverage:
        assert coverage.installed["blocks.0.mlp.hook_post"] == "Half"
    llama = boot("llama")
    for act, message in (("tanh", "do not know the activation 'tanh'"), (None, "reports none")):
        with pytest.raises(UnsupportedFeatureError, match=message):
            with use_relevance_rules(_Reporting(llama, act)):
                pass
    assert hook_count(llama) == 0
    with use_relevance_rules(
        _Reporting(llama, None), RelevanceRules(activation=False, multiplicative_gate=False)
    ):
        pass


def test_sites_the_rule_cannot_reach_are_refused() -> None:
    bridge = boot("gpt2")
    bridge.set_use_split_qkv_input(True)  # attention then reads per-head copies, not ln1
    with pytest.raises(UnsupportedFeatureError, match=r"blocks\.0\.ln1\.hook_normalized.*per-head"):
        with use_relevance_rules(bridge):
            pass
    assert hook_count(bridge) == 0
    with pytest.raises(UnsupportedFeatureError, match="no gradients"):
        with use_relevance_rules(_NoGradients()):
            pass
    with pytest.raises(UserError, match="RelevanceRules"):
        with use_relevance_rules(bridge, {"attention": False}):  # type: ignore[arg-type]
            pass
    with pytest.raises(UserError, match="True or False"):
        RelevanceRules(attention=1)  # type: ignore[arg-type]


class _NoGradients:
    """A bridge over a driver without gradients."""

    def __init__(self) -> None:
        self.driver = SimpleNamespace(name="remote", supports=lambda feature: False)
        self.hook_dict: dict[str, Any] = {}


def test_norm_less_model_gets_no_norm_rows() -> None:
    bridge = boot("gpt2", normalization_type=None)
    with use_relevance_rules(bridge) as coverage:
        assert set(coverage.installed) == {
            f"blocks.{i}.{s}" for i in range(2) for s in ("attn.hook_pattern", "mlp.hook_post")
        }
