"""Python hooks: forward edits, backward hooks, cleanup, the hooks() context, gradients."""

from __future__ import annotations

import pytest
import torch

from tl_core import HookPoint, TransformerBridge


def _active_hooks(bridge: TransformerBridge) -> int:
    return sum(len(p._fwd) + len(p._bwd) for p in bridge.hook_dict.values())


def test_forward_hook_edits_propagate_and_are_removed(bridge: TransformerBridge) -> None:
    clean = bridge("Edit me")

    def zero(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        assert hook.name == "blocks.0.hook_out"
        return torch.zeros_like(x)

    edited = bridge.run_with_hooks("Edit me", fwd_hooks=[("blocks.0.hook_resid_post", zero)])
    assert not torch.allclose(clean, edited)
    assert _active_hooks(bridge) == 0
    torch.testing.assert_close(bridge("Edit me"), clean)


def test_hooks_are_removed_when_the_forward_raises(bridge: TransformerBridge) -> None:
    def boom(x: torch.Tensor, hook: HookPoint) -> None:
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        bridge.run_with_hooks("x", fwd_hooks=[("blocks.1.mlp.hook_post", boom)])
    assert _active_hooks(bridge) == 0
    with pytest.raises(RuntimeError), bridge.hooks([("blocks.1.hook_out", boom)]):
        bridge("x")
    assert _active_hooks(bridge) == 0


def test_predicate_hooks_and_read_only_hooks(bridge: TransformerBridge) -> None:
    seen: list[str] = []
    logits = bridge.run_with_hooks(
        "abc",
        fwd_hooks=[
            (lambda n: n.endswith("attn.hook_pattern"), lambda x, hook: seen.append(hook.name))
        ],
    )
    assert seen == [f"blocks.{i}.attn.hook_pattern" for i in range(bridge.cfg.n_layers)]
    torch.testing.assert_close(logits, bridge("abc"))


def test_backward_hooks_reach_every_residual_hook(bridge: TransformerBridge) -> None:
    grads: dict[str, torch.Tensor] = {}

    def keep(grad: torch.Tensor, hook: HookPoint) -> None:
        grads[hook.name] = grad

    names = [f"blocks.{i}.hook_out" for i in range(bridge.cfg.n_layers)] + ["embed.hook_out"]
    with bridge.hooks(bwd_hooks=[(n, keep) for n in names]):
        loss = bridge.loss("Gradients flow backwards")
        loss.backward()
    assert set(grads) == set(names)
    for name, grad in grads.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert _active_hooks(bridge) == 0
    bridge.zero_grad()


def test_gradient_of_a_hook_value_matches_autograd(bridge: TransformerBridge) -> None:
    captured: dict[str, torch.Tensor] = {}

    def grab(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        x.retain_grad()
        captured["x"] = x
        return x

    grads: dict[str, torch.Tensor] = {}
    with bridge.hooks(
        [("blocks.1.hook_in", grab)],
        [("blocks.1.hook_in", lambda g, hook: grads.setdefault("g", g))],
    ):
        bridge.loss("check the gradient").backward()
    torch.testing.assert_close(grads["g"], captured["x"].grad)
    bridge.zero_grad()


def test_incl_bwd_caches_gradients(bridge: TransformerBridge) -> None:
    loss, cache = bridge.run_with_cache(
        "grad cache",
        names_filter=["blocks.0.hook_out", "blocks.2.hook_out"],
        incl_bwd=True,
        return_type="loss",
    )
    assert loss.ndim == 0
    assert set(cache.grads) == {"blocks.0.hook_out", "blocks.2.hook_out"}
    assert cache.grads["blocks.0.hook_out"].shape == cache["blocks.0.hook_out"].shape
    assert _active_hooks(bridge) == 0
    bridge.zero_grad()


def test_permanent_hooks_survive_reset_unless_asked(bridge: TransformerBridge) -> None:
    calls: list[int] = []
    bridge.add_hook("blocks.0.hook_out", lambda x, hook: calls.append(1), is_permanent=True)
    bridge.reset_hooks()
    bridge("a")
    assert calls == [1]
    bridge.reset_hooks(including_permanent=True)
    bridge("a")
    assert calls == [1]


def test_weight_accessors_have_hookedtransformer_shapes(bridge: TransformerBridge) -> None:
    c = bridge.cfg
    assert bridge.W_Q.shape == (c.n_layers, c.n_heads, c.d_model, c.d_head)
    assert bridge.W_K.shape == (c.n_layers, c.kv_heads, c.d_model, c.d_head)
    assert bridge.W_O.shape == (c.n_layers, c.n_heads, c.d_head, c.d_model)
    assert bridge.W_in.shape == (c.n_layers, c.d_model, c.d_mlp)
    assert bridge.W_out.shape == (c.n_layers, c.d_mlp, c.d_model)
    assert bridge.W_E.shape == (c.d_vocab, c.d_model)
    assert bridge.W_U.shape == (c.d_model, c.d_vocab)
    assert any(p.requires_grad for p in bridge.parameters())
