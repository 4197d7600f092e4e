"""Relevance rules (RelP's LRP rules) on tiny Qwen2 and Phi-3 checkpoints.

Phi-3 fuses gate and up into one projection, which the driver splits into ``mlp.hook_pre``
and ``mlp.hook_pre_linear``; Qwen2 keeps them apart. On both the forward must keep its bits,
the coverage must list exactly the sites ``ModelInfo`` implies, and each rule's gradient must
match its closed form (see ``packages/tl-core/tests/test_relevance_rules.py`` for the
formulas), computed here from captured values with plain torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tl_core import TransformerBridge
from tl_core.analysis import RelevanceRules, use_relevance_rules

FAMILIES = ("qwen2", "phi3")


@pytest.fixture(params=FAMILIES)
def bridge(
    request: pytest.FixtureRequest, bridge_of: Callable[[str], TransformerBridge]
) -> TransformerBridge:
    return bridge_of(str(request.param))


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].log_softmax(-1)[:, 7].sum() + logits[:, 3, 11].sum()


def trace(
    bridge: TransformerBridge, ids: torch.Tensor, names: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Values and gradients at ``names`` (a gradient only where one arrived)."""
    values: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, hook: Any) -> None:
        values[hook.name] = x.detach().clone()

    def keep_grad(g: torch.Tensor, hook: Any) -> None:
        grads[hook.name] = g.detach().clone()

    with bridge.hooks([(n, keep) for n in names], [(n, keep_grad) for n in names]):
        metric(bridge(ids)).backward()
    return values, grads


def test_model_info_reports_the_activation(bridge: TransformerBridge) -> None:
    assert bridge.cfg.act_fn == "silu"


def test_forward_is_bit_identical(bridge: TransformerBridge, ids: torch.Tensor) -> None:
    plain = bridge(ids)
    with use_relevance_rules(bridge):
        assert torch.equal(bridge(ids), plain)
    with use_relevance_rules(bridge, RelevanceRules(attention=False)):
        assert torch.equal(bridge(ids), plain)
    assert not any(p.has_hooks for p in bridge.hook_dict.values())


def test_coverage_is_exact(bridge: TransformerBridge) -> None:
    info = bridge.cfg
    assert info.gated_mlp and info.normalization_type == "RMS"
    assert not (info.sandwich_norm or info.qk_norm or info.embed_norm)
    expected: dict[str, tuple[str, tuple[str, ...]]] = {}
    for i in range(info.n_layers):
        b = f"blocks.{i}."
        for norm in ("ln1", "ln2"):
            expected[f"{b}{norm}.hook_normalized"] = (
                "LN",
                (f"{b}{norm}.hook_in", f"{b}{norm}.hook_scale"),
            )
        expected[b + "attn.hook_pattern"] = ("attention", ())
        expected[b + "mlp.hook_post"] = (
            "Identity+Half",
            (b + "mlp.hook_pre", b + "mlp.hook_pre_linear"),
        )
    expected["ln_final.hook_normalized"] = ("LN", ("ln_final.hook_in", "ln_final.hook_scale"))
    with use_relevance_rules(bridge) as coverage:
        assert {s.site: (s.rule, s.reads) for s in coverage.sites} == expected
        assert coverage.skipped == {} and len(coverage.installed) == len(expected)
        assert f"{len(expected)} installed, 0 skipped" in str(coverage)


def test_each_rule_matches_its_closed_form(bridge: TransformerBridge, ids: torch.Tensor) -> None:
    info = bridge.cfg
    m, a = "blocks.1.mlp.", "blocks.0.attn."
    names = [
        "ln_final.hook_in", "ln_final.hook_scale", "ln_final.hook_normalized",
        m + "hook_pre", m + "hook_pre_linear", m + "hook_post",
        a + "hook_rot_q", a + "hook_rot_k", a + "hook_attn_scores", a + "hook_v",
        a + "hook_pattern", a + "hook_z",
    ]  # fmt: skip
    with use_relevance_rules(bridge):
        values, grads = trace(bridge, ids, names)
    # LN-rule on RMSNorm: the gradient is divided by the scale and nothing else.
    g, s = grads["ln_final.hook_normalized"], values["ln_final.hook_scale"]
    assert "ln_final.hook_scale" not in grads
    torch.testing.assert_close(grads["ln_final.hook_in"], g / s, rtol=1e-5, atol=1e-8)
    # Identity-rule then Half-rule on silu(gate) * up (Phi-3: halves of one fused output).
    pre, up, g = values[m + "hook_pre"], values[m + "hook_pre_linear"], grads[m + "hook_post"]
    torch.testing.assert_close(values[m + "hook_post"], F.silu(pre) * up, rtol=1e-6, atol=1e-7)
    ratio = torch.where(pre == 0, torch.full_like(pre, 0.5), F.silu(pre) / pre)
    torch.testing.assert_close(grads[m + "hook_pre"], 0.5 * up * g * ratio, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(
        grads[m + "hook_pre_linear"], 0.5 * F.silu(pre) * g, rtol=1e-5, atol=1e-8
    )
    # Attention probabilities are constants: nothing reaches q, k or the scores, and the
    # value gradient is pattern^T grad_z, summed over each key/value head's query heads.
    for silent in ("hook_rot_q", "hook_rot_k", "hook_attn_scores"):
        assert a + silent not in grads
    pattern, g_z = values[a + "hook_pattern"], grads[a + "hook_z"]
    per_head = torch.einsum("bhqk,bqhe->bkhe", pattern, g_z)
    group = info.n_heads // info.kv_heads
    expected_v = per_head.unflatten(2, (info.kv_heads, group)).sum(3)
    torch.testing.assert_close(grads[a + "hook_v"], expected_v, rtol=1e-5, atol=1e-8)
