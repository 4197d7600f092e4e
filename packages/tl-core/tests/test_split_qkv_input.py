"""Per-head q/k/v inputs (``set_use_split_qkv_input``) on the native driver.

References are written from the formulas with the model's own weights (a hand-written
norm, ``W_Q[h]``, ``b_Q[h]``), never with the split code under test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch

from tl_core import (
    HookNameError,
    HookPoint,
    SpecError,
    TransformerBridge,
    UnsupportedFeatureError,
    UserError,
)
from tl_core.driver_api._local import LocalDriver
from tl_core.native._config import NativeConfig
from tl_core.native._driver import NativeDriver
from tl_core.native._model import NativeTransformer, TransformerBlock

#: name -> (preset, overrides): both block styles, multi-query keys and a model without norms.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", {}),
    "llama": ("llama", {}),  # grouped-query: 4 query heads, 2 key/value heads
    "llama-mqa": ("llama", {"n_key_value_heads": 1}),
    "no-norm": ("gpt2", {"normalization_type": None}),
}
KINDS = ("q", "k", "v")
SPLIT = tuple(f"attn.hook_{x}_input" for x in KINDS)
#: The sites attention stops reading while the per-head inputs are on.
BYPASSED = ("ln1.hook_scale", "ln1.hook_normalized", "ln1.hook_out", "attn.hook_in")


def _boot(name: str, **extra: Any) -> TransformerBridge:
    preset, overrides = MODELS[name]
    # xavier_normal weights give peaked patterns, so a wrong head shows up clearly.
    return TransformerBridge.boot_native(
        preset, n_layers=2, seed=3, init_mode="xavier_normal", **overrides, **extra
    )


@pytest.fixture(params=list(MODELS))
def bridge(request: pytest.FixtureRequest) -> Iterator[TransformerBridge]:
    """A fresh two-layer model of each kind (tests switch it, so none is shared)."""
    bridge = _boot(request.param)
    yield bridge
    bridge.set_use_split_qkv_input(False)


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 259, (2, 7), generator=torch.Generator().manual_seed(11))


def _block(bridge: TransformerBridge, layer: int) -> TransformerBlock:
    block = bridge.model.blocks[layer]
    assert isinstance(block, TransformerBlock)
    return block


def _heads(bridge: TransformerBridge, kind: str) -> int:
    return bridge.cfg.n_heads if kind == "q" else bridge.cfg.kv_heads


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float rounding: the per-head einsum may round differently from the
    fused projection for some shapes (one ulp, measured), though it is often bit-equal."""
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def _assert_close_to_scale(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Close relative to the largest entry: sums of float32 gradients over many paths."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * max(scale, 1.0), msg=what)


def _run(
    bridge: TransformerBridge,
    ids: torch.Tensor,
    names: Iterable[str] = (),
    *,
    edits: Iterable[tuple[str, Callable[..., Any]]] = (),
    grads_of: Iterable[str] = (),
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Logits, the values at ``names`` and, with ``grads_of``, the gradients there of a fixed
    random projection of the logits."""
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, hook: HookPoint) -> None:
        acts[hook.name] = x.detach().clone()

    def keep_grad(g: torch.Tensor, hook: HookPoint) -> None:
        grads[hook.name] = g.detach().clone()

    fwd = [*edits, *((n, keep) for n in names)]
    bwd = [(n, keep_grad) for n in grads_of]
    with bridge.hooks(fwd, bwd):
        logits = bridge(ids)
        if bwd:
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
            (logits * weights).sum().backward()
    bridge.zero_grad(set_to_none=True)
    return logits.detach(), acts, grads


def _ln1_reference(
    bridge: TransformerBridge, block: TransformerBlock, x: torch.Tensor
) -> torch.Tensor:
    """ln1 written from its formula over the last axis."""
    kind = bridge.model.cfg.normalization_type
    eps = bridge.model.cfg.eps
    if kind is None:
        return x
    if kind == "LN":
        x = x - x.mean(dim=-1, keepdim=True)
        scale = torch.sqrt(x.var(dim=-1, unbiased=False, keepdim=True) + eps)
    else:
        scale = torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    assert block.ln1.w is not None
    out = x / scale * block.ln1.w.detach()
    return out if block.ln1.b is None else out + block.ln1.b.detach()


# -- switching ------------------------------------------------------------------------


def test_logits_are_unchanged_and_sites_listed_only_while_on(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    sites = {f"blocks.{i}.{s}" for i in range(bridge.cfg.n_layers) for s in SPLIT}
    off = bridge(ids)
    assert not sites & set(bridge.hook_dict)
    assert not sites & bridge.namespace.served
    assert bridge.driver.split_qkv_input is False

    assert bridge.set_use_split_qkv_input(True) is bridge
    assert_same_logits(bridge(ids), off)
    assert sites <= set(bridge.hook_dict)
    assert sites <= bridge.namespace.editable
    assert all(block.split_qkv_input for block in bridge.model.blocks)
    for i in range(bridge.cfg.n_layers):
        for x in KINDS:
            # The legacy HookedTransformer name is an alias of the canonical site.
            assert (
                bridge.namespace.lookup(f"blocks.{i}.hook_{x}_input")
                == f"blocks.{i}.attn.hook_{x}_input"
            )
            assert (
                bridge.get_hook_point(f"blocks.{i}.hook_{x}_input")
                is bridge.hook_dict[f"blocks.{i}.attn.hook_{x}_input"]
            )

    bridge.set_use_split_qkv_input(False)
    assert torch.equal(bridge(ids), off)
    assert not sites & set(bridge.hook_dict)
    assert not any(block.split_qkv_input for block in bridge.model.blocks)


def test_switching_off_restores_the_namespace_exactly(bridge: TransformerBridge) -> None:
    before = bridge.namespace
    legacy = "blocks.1.hook_q_input"
    with pytest.raises(HookNameError) as raised:
        before.lookup(legacy)
    assert "set_use_split_qkv_input(True)" in str(raised.value)

    bridge.set_use_split_qkv_input(True)
    during = bridge.namespace
    assert during is not before
    assert during.served == before.served | {
        f"blocks.{i}.{s}" for i in range(bridge.cfg.n_layers) for s in SPLIT
    }
    bypassed = {
        f"blocks.{i}.{s}" for i in range(bridge.cfg.n_layers) for s in BYPASSED
    } & before.served
    assert during.read_only == before.read_only | bypassed
    for name in bypassed:
        assert "set_use_split_qkv_input(False)" in during.reasons[name], name

    bridge.set_use_split_qkv_input(False)
    after = bridge.namespace
    assert (after.served, after.editable, dict(after.reasons)) == (
        before.served,
        before.editable,
        dict(before.reasons),
    )
    with pytest.raises(HookNameError) as again:
        after.lookup(legacy)
    assert str(again.value) == str(raised.value)


def test_switching_twice_is_harmless_and_only_bools_are_taken(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    off = bridge(ids)
    bridge.set_use_split_qkv_input(True)
    bridge.set_use_split_qkv_input(True)
    assert_same_logits(bridge(ids), off)
    for wrong in (1, "yes", None):
        with pytest.raises(UserError, match="takes a bool"):
            bridge.set_use_split_qkv_input(wrong)  # type: ignore[arg-type]
    assert bridge.driver.split_qkv_input is True
    bridge.set_use_split_qkv_input(False)
    bridge.set_use_split_qkv_input(False)
    assert bridge.driver.split_qkv_input is False
    assert torch.equal(bridge(ids), off)


def test_booting_with_the_config_flag_turns_them_on() -> None:
    bridge = _boot("llama", use_split_qkv_input=True)
    assert bridge.driver.split_qkv_input is True
    assert "blocks.0.attn.hook_k_input" in bridge.hook_dict
    assert "blocks.0.ln1.hook_out" in bridge.namespace.read_only
    off = _boot("llama")
    ids = torch.arange(3, 12)[None]
    assert_same_logits(bridge(ids), off(ids))
    bridge.set_use_split_qkv_input(False)
    assert "blocks.0.attn.hook_k_input" not in bridge.hook_dict


def test_shapes_follow_query_and_key_value_heads(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    bridge.set_use_split_qkv_input(True)
    names = [f"blocks.0.{s}" for s in SPLIT] + ["blocks.0.hook_in"]
    _, acts, _ = _run(bridge, ids, names)
    for kind in KINDS:
        copies = acts[f"blocks.0.attn.hook_{kind}_input"]
        n = _heads(bridge, kind)
        assert copies.shape == (*ids.shape, n, bridge.cfg.d_model)
        assert bridge.namespace.feature_shape(f"blocks.0.attn.hook_{kind}_input") == (
            n,
            bridge.cfg.d_model,
        )
        # Each copy is the block input itself (before ln1).
        for h in range(n):
            assert torch.equal(copies[:, :, h], acts["blocks.0.hook_in"])


# -- gradients ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layer", [0, 1])
def test_each_heads_input_gradient_is_that_heads_own_vjp(
    bridge: TransformerBridge, ids: torch.Tensor, kind: str, layer: int
) -> None:
    bridge.set_use_split_qkv_input(True)
    b = f"blocks.{layer}."
    site, out_site = f"{b}attn.hook_{kind}_input", f"{b}attn.hook_{kind}"
    _, acts, grads = _run(bridge, ids, [b + "hook_in"], grads_of=[site, out_site])
    x, g_out, g_in = acts[b + "hook_in"], grads[out_site], grads[site]
    block = _block(bridge, layer)
    w = getattr(block.attn, f"W_{kind.upper()}").detach()
    bias = getattr(block.attn, f"b_{kind.upper()}")
    assert g_in.shape[2] == w.shape[0] == _heads(bridge, kind)
    for h in range(w.shape[0]):
        xh = x.clone().requires_grad_(True)
        out = _ln1_reference(bridge, block, xh) @ w[h]
        if bias is not None:
            out = out + bias.detach()[h]
        (expected,) = torch.autograd.grad(out, xh, g_out[:, :, h])
        torch.testing.assert_close(
            g_in[:, :, h], expected, rtol=1e-5, atol=1e-6, msg=f"{site} head {h}"
        )
    # The heads' gradients are their own, not one shared value.
    assert not torch.allclose(g_in[:, :, 0], g_in[:, :, -1]) or g_in.shape[2] == 1


@pytest.mark.parametrize("layer", [0, 1])
def test_per_head_gradients_and_the_skip_path_add_up_to_the_block_input_gradient(
    bridge: TransformerBridge, ids: torch.Tensor, layer: int
) -> None:
    b = f"blocks.{layer}."
    _, _, plain = _run(bridge, ids, grads_of=[b + "hook_in"])
    bridge.set_use_split_qkv_input(True)
    split_sites = [b + s for s in SPLIT]
    _, _, grads = _run(bridge, ids, grads_of=[b + "hook_in", b + "hook_resid_mid", *split_sites])
    # A sequential block is x + attn(x) + mlp(...): the skip path's gradient is resid_mid's.
    total = grads[b + "ln2.hook_in"] + sum(grads[s].sum(dim=2) for s in split_sites)
    _assert_close_to_scale(total, plain[b + "hook_in"], "per-head sum + skip path")
    # And splitting changes no gradient upstream.
    _assert_close_to_scale(grads[b + "hook_in"], plain[b + "hook_in"], "block input")


def test_parameter_gradients_are_unchanged(bridge: TransformerBridge, ids: torch.Tensor) -> None:
    def param_grads() -> dict[str, torch.Tensor]:
        logits = bridge(ids)
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
        (logits * weights).sum().backward()
        found = {
            n: p.grad.clone() for n, p in bridge.model.named_parameters() if p.grad is not None
        }
        bridge.zero_grad(set_to_none=True)
        return found

    plain = param_grads()
    bridge.set_use_split_qkv_input(True)
    split = param_grads()
    assert plain.keys() == split.keys()
    for name, grad in plain.items():
        # b_K's gradient is rounding noise (softmax ignores a per-row shift): absolute atol.
        torch.testing.assert_close(split[name], grad, rtol=1e-4, atol=1e-5, msg=name)


# -- edits ----------------------------------------------------------------------------


def _add_to_head(head: int, vec: torch.Tensor) -> Callable[..., torch.Tensor]:
    def edit(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        x = x.clone()
        x[:, :, head] += vec
        return x

    return edit


@pytest.mark.parametrize("kind", KINDS)
def test_editing_one_heads_copy_changes_only_that_head(
    bridge: TransformerBridge, ids: torch.Tensor, kind: str
) -> None:
    bridge.set_use_split_qkv_input(True)
    n_heads, n_kv = bridge.cfg.n_heads, bridge.cfg.kv_heads
    group = n_heads // n_kv
    outs = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.0.attn.hook_v"]
    names = [*outs, "blocks.0.attn.hook_pattern", "blocks.0.attn.hook_z"]
    _, clean, _ = _run(bridge, ids, names)
    vec = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(2))
    for target in sorted({0, _heads(bridge, kind) - 1}):
        _, edited, _ = _run(
            bridge,
            ids,
            names,
            edits=[(f"blocks.0.attn.hook_{kind}_input", _add_to_head(target, vec))],
        )
        for x, out in zip(KINDS, outs, strict=True):
            for h in range(clean[out].shape[2]):
                same = torch.equal(edited[out][:, :, h], clean[out][:, :, h])
                assert same is not (x == kind and h == target), (out, h, target)
        # Which query heads see it: the one head for q, the kv head's group for k and v.
        readers = {target} if kind == "q" else {h for h in range(n_heads) if h // group == target}
        for h in range(n_heads):
            pattern_same = torch.equal(
                edited["blocks.0.attn.hook_pattern"][:, h],
                clean["blocks.0.attn.hook_pattern"][:, h],
            )
            z_same = torch.equal(
                edited["blocks.0.attn.hook_z"][:, :, h], clean["blocks.0.attn.hook_z"][:, :, h]
            )
            assert pattern_same is (kind == "v" or h not in readers), ("pattern", h, target)
            assert z_same is (h not in readers), ("z", h, target)


def test_an_edit_to_every_copy_equals_the_same_edit_before_ln1(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    vec = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(4))

    def add(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        return x + vec

    # Without split, an edit of ln1's input (attention's, without norms) moves q, k and v of
    # every head together.
    site = (
        "blocks.1.ln1.hook_in"
        if "blocks.1.ln1.hook_in" in bridge.hook_dict
        else "blocks.1.attn.hook_in"
    )
    expected, _, _ = _run(bridge, ids, edits=[(site, add)])
    bridge.set_use_split_qkv_input(True)
    got, _, _ = _run(bridge, ids, edits=[(f"blocks.1.{s}", add) for s in SPLIT])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_an_edit_of_ln1s_input_reaches_attention_either_way(name: str, ids: torch.Tensor) -> None:
    bridge = _boot(name)
    vec = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(6))

    def add(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        return x + vec

    clean = bridge(ids)
    expected, _, _ = _run(bridge, ids, edits=[("blocks.0.ln1.hook_in", add)])
    assert not torch.allclose(expected, clean)
    bridge.set_use_split_qkv_input(True)
    got, _, _ = _run(bridge, ids, edits=[("blocks.0.ln1.hook_in", add)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_specs_edit_the_copies(bridge: TransformerBridge, ids: torch.Tensor) -> None:
    bridge.set_use_split_qkv_input(True)
    clean = bridge(ids)
    for x in KINDS:
        edited = bridge(
            ids, intervene={f"blocks.0.hook_{x}_input": {"op": "scale", "factor": 0.5, "pos": -1}}
        )
        assert not torch.equal(edited[:, -1], clean[:, -1]), x
        assert torch.equal(edited[:, :-1], clean[:, :-1]), x  # causal: earlier positions untouched


def test_bypassed_sites_refuse_specs_while_on_and_take_them_after(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    names = [f"blocks.0.{s}" for s in BYPASSED if f"blocks.0.{s}" in bridge.hook_dict]
    assert "blocks.0.attn.hook_in" in names
    spec = {"op": "scale", "factor": 1.5}
    before = {n: bridge(ids, intervene={n: spec}) for n in names}
    bridge.set_use_split_qkv_input(True)
    for name in names:
        assert name in bridge.namespace.read_only
        with pytest.raises(SpecError, match="per-head q/k/v inputs are on") as raised:
            bridge(ids, intervene={name: spec})
        assert name in str(raised.value) and "set_use_split_qkv_input(False)" in str(raised.value)
    # Capture still works there.
    _, cache = bridge.run_with_cache(ids, names_filter=names)
    assert set(cache.keys()) == set(names)
    bridge.set_use_split_qkv_input(False)
    for name in names:
        assert torch.equal(bridge(ids, intervene={name: spec}), before[name]), name


def test_bypassed_sites_refuse_python_hook_edits_while_on(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    names = [f"blocks.0.{s}" for s in BYPASSED if f"blocks.0.{s}" in bridge.hook_dict]

    def double(x: torch.Tensor, hook: Any) -> torch.Tensor:
        return x * 2

    bridge.set_use_split_qkv_input(True)
    try:
        for name in names:
            with pytest.raises(UserError, match="per-head q/k/v inputs are on"):
                bridge.run_with_hooks(ids, fwd_hooks=[(name, double)])
            bridge.run_with_hooks(ids, fwd_hooks=[(name, lambda x, hook: None)])  # reading is fine
    finally:
        bridge.set_use_split_qkv_input(False)
    for name in names:
        assert not torch.equal(
            bridge.run_with_hooks(ids, fwd_hooks=[(name, double)]), bridge(ids)
        ), name


class _NoSplitDriver(NativeDriver):
    """A local driver that has no per-head inputs (the base class's answer)."""

    _apply_split_qkv_input = LocalDriver._apply_split_qkv_input


def test_a_driver_without_per_head_inputs_refuses_and_stays_as_it_was(ids: torch.Tensor) -> None:
    bridge = TransformerBridge(
        _NoSplitDriver(NativeTransformer(NativeConfig.llama_style(n_layers=2)))
    )
    clean, served = bridge(ids), bridge.namespace.served
    with pytest.raises(UnsupportedFeatureError, match="has no per-head q/k/v inputs"):
        bridge.set_use_split_qkv_input(True)
    assert bridge.driver.split_qkv_input is False
    assert bridge.namespace.served == served
    assert "blocks.0.ln1.hook_out" in bridge.namespace.editable
    assert torch.equal(bridge(ids), clean)


# -- cleanup --------------------------------------------------------------------------


def test_turning_off_in_finally_after_an_exception_restores_the_model(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    clean = bridge(ids)
    names = set(bridge.hook_dict)

    def boom(x: torch.Tensor, hook: HookPoint) -> None:
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        bridge.set_use_split_qkv_input(True)
        try:
            bridge.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_v_input", boom)])
        finally:
            bridge.set_use_split_qkv_input(False)
    assert bridge.driver.split_qkv_input is False
    assert not any(block.split_qkv_input for block in bridge.model.blocks)
    assert set(bridge.hook_dict) == names
    assert sum(len(p._fwd) + len(p._bwd) for p in bridge.model._hook_points.values()) == 0
    assert torch.equal(bridge(ids), clean)


def test_start_and_stop_at_layer_agree_with_split_on(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    resid = bridge(ids, stop_at_layer=1)
    tail = bridge(None, start_at_layer=1, residual=resid, tokens=ids)
    bridge.set_use_split_qkv_input(True)
    assert torch.equal(bridge(ids, stop_at_layer=1), resid)
    assert torch.equal(bridge(None, start_at_layer=1, residual=resid, tokens=ids), tail)
