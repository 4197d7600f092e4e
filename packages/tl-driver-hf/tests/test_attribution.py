"""Attribution patching on every family, against backward hooks, autograd and finite differences.

References never use ``attribution_patch``'s probes: gradients come from ``HookPoint``
backward hooks and from ``torch.autograd`` through the transformers norm modules (located
by ``_paths``), perturbations are plain forward hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tl_core import TransformerBridge, UnsupportedFeatureError
from tl_core.analysis import attribution_patch, logit_diff_metric

METRIC = logit_diff_metric(5, 9)


def _corrupt(ids: torch.Tensor) -> torch.Tensor:
    out = ids.clone()
    out[:, 3] = (ids[:, 3] + 17) % 500 + 4
    out[:, 6] = (ids[:, 6] + 5) % 500 + 4
    return out


def _grad_at(
    bridge: TransformerBridge, ids: torch.Tensor, site: str, *, split: bool = False
) -> torch.Tensor:
    """d METRIC / d site on ``ids``, from a backward hook."""
    grads: dict[str, torch.Tensor] = {}

    def keep(grad: torch.Tensor, hook: Any) -> None:
        grads["g"] = grad.detach()

    bridge.set_use_split_qkv_input(split)
    try:
        with bridge.hooks(bwd_hooks=[(site, keep)]):
            METRIC(bridge(ids)).sum().backward()
    finally:
        bridge.set_use_split_qkv_input(False)
        bridge.model.zero_grad()
    return grads["g"]


def _values(bridge: TransformerBridge, ids: torch.Tensor, site: str) -> torch.Tensor:
    with torch.no_grad():
        return bridge.run_with_cache(ids, names_filter=[site])[1][site]


def test_every_family_scores_nodes_and_edges_that_add_up(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    corrupt = _corrupt(ids)
    last = bridge.cfg.n_layers - 1
    if bridge.cfg.sandwich_norm:
        with pytest.raises(UnsupportedFeatureError, match="own norm"):
            attribution_patch(bridge, ids, corrupt, METRIC, granularity="edge")
        result = attribution_patch(bridge, ids, corrupt, METRIC)
        assert result.top_nodes(1)[0].score != 0
        return
    result = attribution_patch(bridge, ids, corrupt, METRIC, granularity="both")
    assert not bridge.driver.split_qkv_input
    # The per-head result is a linear image of z: the same score.
    z, head_result = (
        result.nodes[f"blocks.{last}.attn.hook_z"],
        result.nodes[f"blocks.{last}.attn.hook_result"],
    )
    torch.testing.assert_close(head_result, z, rtol=1e-3, atol=1e-5)
    assert result.edges_per_pair is not None
    final = f"blocks.{last}.hook_out"
    delta = _values(bridge, ids, final) - _values(bridge, corrupt, final)
    expected = (delta * _grad_at(bridge, corrupt, final)).sum(dim=(1, 2))
    incoming = result.edges_per_pair[:, :, result.readers.index("logits")].sum(1)
    torch.testing.assert_close(incoming, expected, rtol=2e-3, atol=1e-4)
    # A query head's incoming edges: the block input's delta against that head's own copy.
    block_in = f"blocks.{last}.hook_in"
    delta = _values(bridge, ids, block_in) - _values(bridge, corrupt, block_in)
    grad = _grad_at(bridge, corrupt, f"blocks.{last}.attn.hook_q_input", split=True)[:, :, 1]
    incoming = result.edges_per_pair[:, :, result.readers.index(f"L{last}H1.q")].sum(1)
    torch.testing.assert_close(incoming, (delta * grad).sum(dim=(1, 2)), rtol=2e-3, atol=1e-4)


@pytest.fixture(scope="module")
def float64_bridge(checkpoint: Callable[[str], Path]) -> Callable[[str], TransformerBridge]:
    made: dict[str, TransformerBridge] = {}

    def get(family: str) -> TransformerBridge:
        if family not in made:
            made[family] = TransformerBridge.boot_transformers(
                str(checkpoint(family)), dtype="float64"
            )
        return made[family]

    return get


def _mlp_reader_gradient(
    bridge: TransformerBridge, paths: dict[str, Any], ids: torch.Tensor, layer: int
) -> tuple[str, torch.Tensor]:
    """(the MLP's residual input site, its gradient through the MLP's norm only), by autograd."""
    parallel = bool(paths.get("parallel"))
    site = f"blocks.{layer}.hook_in" if parallel else f"blocks.{layer}.ln2.hook_in"
    grad_in = _grad_at(bridge, ids, f"blocks.{layer}.mlp.hook_in", split=True)
    layer_module = bridge.driver.hf_model.get_submodule(paths["layers"])[layer]
    norm = layer_module.get_submodule(paths.get("ln2") or paths["ln1"])
    x = _values(bridge, ids, site).clone().requires_grad_(True)
    (grad_x,) = torch.autograd.grad(norm(x), x, grad_in)
    return site, grad_x


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "gptj"])
def test_an_mlps_incoming_edges_sum_to_its_input_delta_against_its_own_gradient(
    family: str,
    paths: dict[str, Any],
    float64_bridge: Callable[[str], TransformerBridge],
    ids: torch.Tensor,
) -> None:
    bridge = float64_bridge(family)
    corrupt = _corrupt(ids)
    result = attribution_patch(bridge, ids, corrupt, METRIC, granularity="edge")
    assert result.edges_per_pair is not None
    for layer in range(bridge.cfg.n_layers):
        site, grad = _mlp_reader_gradient(bridge, paths, corrupt, layer)
        delta = _values(bridge, ids, site) - _values(bridge, corrupt, site)
        incoming = result.edges_per_pair[:, :, result.readers.index(f"L{layer}MLP")].sum(1)
        torch.testing.assert_close(incoming, (delta * grad).sum(dim=(1, 2)), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "gpt_neox"])
@pytest.mark.parametrize(
    "site", ["blocks.0.hook_in", "blocks.0.attn.hook_z", "blocks.1.mlp.hook_out"]
)
def test_node_scores_match_finite_differences(
    family: str, site: str, float64_bridge: Callable[[str], TransformerBridge], ids: torch.Tensor
) -> None:
    bridge = float64_bridge(family)
    corrupt = _corrupt(ids)
    result = attribution_patch(bridge, ids, corrupt, METRIC, sites=[site])
    a_clean, a_corrupt = _values(bridge, ids, site), _values(bridge, corrupt, site)
    # Rotary tables are computed in float32 even in a float64 model: a step small enough
    # to hide curvature would drown in their rounding.
    eps = 1e-3

    def shifted(sign: float) -> torch.Tensor:
        value = a_corrupt + sign * eps * (a_clean - a_corrupt)
        with torch.no_grad():
            return METRIC(bridge.run_with_hooks(corrupt, fwd_hooks=[(site, lambda x, hook: value)]))

    directional = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
    torch.testing.assert_close(
        result.nodes_per_pair[site].flatten(1).sum(1), directional, rtol=1e-3, atol=1e-6
    )
