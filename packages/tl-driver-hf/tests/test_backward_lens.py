"""Backward Lens on transformers models: factor sums against each real weight's ``.grad``.

The weights are located with the independent paths of ``tests/_paths.py`` and their layout
read from the module type (GPT-2's ``Conv1D`` is ``[in, out]``, ``nn.Linear`` is
``[out, in]``); ``backward_lens`` finds both from the numbers alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from tl_core import TransformerBridge, UnsupportedFeatureError
from tl_core.analysis import backward_lens

#: Dense-MLP families (sequential and parallel blocks, Conv1D and Linear, inline MLP).
DENSE = ("gpt2", "gpt_neox", "gptj", "opt", "gpt_neo", "bloom", "falcon")
RTOL = 1e-5  # float32 checkpoints


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 200, (2, 9), generator=generator).tolist()
    return [ids[0], ids[1][:5]]  # ragged


def _weight(
    bridge: TransformerBridge, paths: dict[str, Any], layer: int, role: str
) -> tuple[str, nn.Module]:
    mlp = f"{paths['mlp']}." if paths["mlp"] else ""
    owner = f"hf_model.{paths['layers']}.{layer}.{mlp}{paths[role]}"
    return f"{owner}.weight", bridge.driver.module.get_submodule(owner)


@pytest.mark.parametrize("family", DENSE)
def test_factors_sum_to_each_weights_gradient(
    family: str, bridge: TransformerBridge, paths: dict[str, Any]
) -> None:
    prompts = _prompts()
    bridge.zero_grad(set_to_none=True)
    try:
        result = backward_lens(bridge, prompts)
        assert all(p.grad is None for p in bridge.parameters()), "backward_lens wrote a .grad"
        bridge.loss(prompts).backward()
        errors: dict[str, float] = {}
        for layer in range(bridge.cfg.n_layers):
            for which, role in (("in", "pre"), ("out", "down")):
                name, owner = _weight(bridge, paths, layer, role)
                site = result.sites[(layer, which)]
                assert site.name == name, f"{family} W_{which}[{layer}]: found {site.name}"
                assert site.transposed == (not isinstance(owner, Conv1D)), f"{family} {name} layout"
                want = bridge.driver.module.get_parameter(name).grad
                assert want is not None
                got = result.weight_grad(layer, which)
                assert got.shape == want.shape
                errors[name] = float((got - want).abs().max() / want.abs().max())
                tl = result.weight_grad(layer, which, layout="tl")
                assert tl.shape == (
                    (bridge.cfg.d_model, bridge.cfg.d_mlp)
                    if which == "in"
                    else (bridge.cfg.d_mlp, bridge.cfg.d_model)
                )
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] <= RTOL, (
            f"{family}: {worst} relative error {errors[worst]:.3g} > {RTOL:g}"
        )
    finally:
        bridge.zero_grad(set_to_none=True)


def test_gpt2_projection_reads_the_real_head_and_final_norm(
    bridge_of: Callable[[str], TransformerBridge],
) -> None:
    bridge = bridge_of("gpt2")
    result = backward_lens(bridge, _prompts(), layers=[0])
    hf = bridge.driver.module.hf_model
    head = hf.lm_head.weight.detach()  # [d_vocab, d_model]
    ln_f = hf.transformer.ln_f.weight.detach()
    mask, g = result.mask, result.g[0]
    torch.testing.assert_close(result.vocab_projection(0)[mask], (g @ head.T)[mask])
    folded = (g - g.mean(-1, keepdim=True)) * ln_f
    torch.testing.assert_close(
        result.vocab_projection(0, fold_norm=True)[mask], (folded @ head.T)[mask]
    )
    _, indices = result.top_tokens(0, k=3, negate=True)
    live = mask & (g != 0).any(-1)  # the last token of each prompt predicts nothing
    assert int(live.sum()) == int(mask.sum()) - 2
    assert torch.equal(indices[live], (-g @ head.T).topk(3, dim=-1).indices[live])
    assert bool((indices[~live] == -1).all())


@pytest.mark.parametrize(
    ("family", "reason"), [("llama", "gated MLP"), ("qwen2", "gated MLP"), ("mixtral", "experts")]
)
def test_gated_and_expert_mlps_are_refused_before_any_pass(
    family: str, reason: str, bridge: TransformerBridge
) -> None:
    calls: list[int] = []
    with bridge.hooks([("blocks.0.hook_in", lambda x, hook: calls.append(1))]):
        with pytest.raises(UnsupportedFeatureError, match=reason):
            backward_lens(bridge, _prompts())
    assert calls == []
