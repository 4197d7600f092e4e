"""Per-head q/k/v inputs (``set_use_split_qkv_input``) on every family.

References read the transformers modules directly, located with ``_paths.PATHS`` (written
independently of the driver's adapters): the layer's own ``ln1`` module and the head's rows
of its q/k/v (or fused qkv) weights, never the driver's split code.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tl_core import HookNameError, HookPoint, SpecError, TransformerBridge, UserError

_spec = importlib.util.spec_from_file_location("_hf_paths", Path(__file__).with_name("_paths.py"))
assert _spec is not None and _spec.loader is not None
_paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_paths)
PATHS: dict[str, dict[str, Any]] = _paths.PATHS
PARALLEL: tuple[str, ...] = _paths.PARALLEL

KINDS = ("q", "k", "v")
SPLIT = tuple(f"attn.hook_{x}_input" for x in KINDS)
#: The sites attention stops reading while the per-head inputs are on.
BYPASSED = ("ln1.hook_scale", "ln1.hook_normalized", "ln1.hook_out", "attn.hook_in")


@pytest.fixture
def split(bridge: TransformerBridge) -> Iterator[TransformerBridge]:
    """The family's (shared, cached) bridge, switched off again whatever the test did."""
    yield bridge
    bridge.set_use_split_qkv_input(False)


def _sites(bridge: TransformerBridge) -> set[str]:
    return {f"blocks.{i}.{s}" for i in range(bridge.cfg.n_layers) for s in SPLIT}


def _heads(bridge: TransformerBridge, kind: str) -> int:
    return bridge.cfg.n_heads if kind == "q" else bridge.cfg.kv_heads


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

    bwd = [(n, keep_grad) for n in grads_of]
    with bridge.hooks([*edits, *((n, keep) for n in names)], bwd):
        if bwd:
            logits = bridge(ids)
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
            (logits * weights).sum().backward()
        else:
            with torch.no_grad():
                logits = bridge(ids)
    bridge.zero_grad(set_to_none=True)
    return logits.detach(), acts, grads


def _assert_close_to_scale(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Close relative to the largest entry: float32 gradients summed over many paths."""
    got = got.reshape(expected.shape)
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(
        got, expected, rtol=1e-4, atol=2e-6 * scale, msg=lambda m: f"{what}: {m}"
    )


# -- the transformers modules, located independently ---------------------------------


def _layer(bridge: TransformerBridge, family: str, i: int) -> nn.Module:
    return bridge.driver.hf_model.get_submodule(f"{PATHS[family]['layers']}.{i}")


def _norm(
    bridge: TransformerBridge, family: str, i: int, role: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's norm module of ``role`` (identity when the family has none)."""
    path = PATHS[family].get(role)
    return _layer(bridge, family, i).get_submodule(path) if path else (lambda x: x)


def _head_weights(
    bridge: TransformerBridge, family: str, i: int, kind: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W [heads, d_model, d_head], b [heads, d_head] or None)`` from the module's own rows."""
    p = PATHS[family]
    attn = _layer(bridge, family, i).get_submodule(p["attn"])
    n_heads, n_kv, d_head = bridge.cfg.n_heads, bridge.cfg.kv_heads, bridge.cfg.d_head
    heads = n_heads if kind == "q" else n_kv
    if kind in p:
        module = attn.get_submodule(p[kind])
        rows, bias = module.weight, module.bias
    else:
        module = attn.get_submodule(p["qkv"])
        weight = module.weight.T if p.get("conv1d") else module.weight  # [out, in]
        bias = module.bias
        j = KINDS.index(kind)
        if p.get("qkv_interleaved"):  # per head [q_h | k_h | v_h]
            rows = weight.reshape(n_heads, 3, d_head, -1)[:, j].flatten(0, 1)
            bias = bias.reshape(n_heads, 3, d_head)[:, j].flatten() if bias is not None else None
        else:  # [q | k | v]
            sizes = [n_heads * d_head, n_kv * d_head, n_kv * d_head]
            rows = torch.split(weight, sizes)[j]
            bias = torch.split(bias, sizes)[j] if bias is not None else None
    w = rows.detach().reshape(heads, d_head, -1).transpose(1, 2)
    return w, bias.detach().reshape(heads, d_head) if bias is not None else None


def _head_projection(
    ln1: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor, b: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> ln1(x) @ W[h] (+ b[h])``: one head's q, k or v from its input."""

    def project(x: torch.Tensor) -> torch.Tensor:
        out = ln1(x) @ w
        return out if b is None else out + b

    return project


def _vjp(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (found,) = torch.autograd.grad(fn(x), x, grad.reshape(x.shape[:-1] + grad.shape[-1:]))
    return found


def _no_torch_hooks(bridge: TransformerBridge) -> bool:
    return not any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
        for m in bridge.driver.hf_model.modules()
    )


# -- every family ---------------------------------------------------------------------


def test_logits_are_unchanged_and_sites_listed_only_while_on(
    split: TransformerBridge, ids: torch.Tensor
) -> None:
    bridge, sites = split, _sites(split)
    off, _, _ = _run(bridge, ids)
    assert not sites & set(bridge.hook_dict)
    assert not sites & bridge.namespace.served

    bridge.set_use_split_qkv_input(True)
    names = [f"blocks.0.{s}" for s in SPLIT] + ["blocks.0.hook_in"]
    on, acts, _ = _run(bridge, ids, names)
    torch.testing.assert_close(on, off, rtol=1e-6, atol=1e-6)
    assert sites <= set(bridge.hook_dict)
    assert sites <= bridge.namespace.editable
    for kind in KINDS:
        copies = acts[f"blocks.0.attn.hook_{kind}_input"]
        assert copies.shape == (*ids.shape, _heads(bridge, kind), bridge.cfg.d_model)
        for h in range(copies.shape[2]):
            assert torch.equal(copies[:, :, h], acts["blocks.0.hook_in"]), (kind, h)
        assert (
            bridge.namespace.lookup(f"blocks.1.hook_{kind}_input")
            == f"blocks.1.attn.hook_{kind}_input"
        )

    bridge.set_use_split_qkv_input(False)
    again, _, _ = _run(bridge, ids)
    assert torch.equal(again, off)
    assert not sites & set(bridge.hook_dict)
    assert _no_torch_hooks(bridge)


def test_each_heads_input_gradient_is_that_heads_own_vjp(
    split: TransformerBridge, family: str, ids: torch.Tensor
) -> None:
    bridge = split
    bridge.set_use_split_qkv_input(True)
    outs = [f"blocks.0.attn.hook_{x}" for x in KINDS]
    _, acts, grads = _run(
        bridge, ids, ["blocks.0.hook_in"], grads_of=[*(f"blocks.0.{s}" for s in SPLIT), *outs]
    )
    x = acts["blocks.0.hook_in"]
    ln1 = _norm(bridge, family, 0, "ln1")
    for kind, out in zip(KINDS, outs, strict=True):
        g_in, g_out = grads[f"blocks.0.attn.hook_{kind}_input"], grads[out]
        w, b = _head_weights(bridge, family, 0, kind)
        assert g_in.shape[2] == g_out.shape[2] == w.shape[0] == _heads(bridge, kind)
        for h in range(w.shape[0]):
            expected = _vjp(
                _head_projection(ln1, w[h], b[h] if b is not None else None), x, g_out[:, :, h]
            )
            _assert_close_to_scale(g_in[:, :, h], expected, f"{family} {kind} head {h}")
        if g_in.shape[2] > 1:  # each head's gradient is its own
            assert not torch.allclose(g_in[:, :, 0], g_in[:, :, 1])


def test_per_head_gradients_add_up_to_the_block_input_gradient(
    split: TransformerBridge, family: str, ids: torch.Tensor
) -> None:
    bridge = split
    b = "blocks.0."
    _, plain_acts, plain = _run(
        bridge, ids, [b + "hook_in"], grads_of=[b + "hook_in", b + "attn.hook_in"]
    )
    x = plain_acts[b + "hook_in"]
    bridge.set_use_split_qkv_input(True)
    parallel = family in PARALLEL
    rest = [b + "hook_out", b + "mlp.hook_in"] if parallel else [b + "hook_resid_mid"]
    split_sites = [b + s for s in SPLIT]
    _, _, grads = _run(bridge, ids, grads_of=[b + "hook_in", *rest, *split_sites])
    heads = sum(grads[s].sum(dim=2) for s in split_sites)
    assert isinstance(heads, torch.Tensor)

    if not parallel and "ln1" in PATHS[family]:
        # Attention's share: ln1's vector-Jacobian product of attn.hook_in's gradient without
        # split. (Elsewhere attention's input tensor also feeds the MLP or the residual, so
        # the gradient there is not attention's alone.)
        attention = _vjp(_norm(bridge, family, 0, "ln1"), x, plain[b + "attn.hook_in"])
        _assert_close_to_scale(heads, attention, f"{family}: heads vs attention input")

    # The rest: the skip path (resid_mid's gradient), or for a parallel block the block
    # output's plus the MLP's through its norm.
    if parallel:
        mlp_norm = _norm(bridge, family, 0, "ln2" if "ln2" in PATHS[family] else "ln1")
        skip = grads[b + "hook_out"] + _vjp(mlp_norm, x, grads[b + "mlp.hook_in"])
    else:
        skip = grads[b + "ln2.hook_in"].reshape(x.shape)
    _assert_close_to_scale(
        heads + skip, plain[b + "hook_in"], f"{family}: heads + skip vs block input"
    )
    _assert_close_to_scale(
        grads[b + "hook_in"], plain[b + "hook_in"], f"{family}: block input on vs off"
    )


def _add_to_head(head: int, vec: torch.Tensor) -> Callable[..., torch.Tensor]:
    def edit(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        x = x.clone()
        x[:, :, head] += vec
        return x

    return edit


def test_editing_one_heads_copy_changes_only_that_head(
    split: TransformerBridge, family: str, ids: torch.Tensor
) -> None:
    bridge = split
    bridge.set_use_split_qkv_input(True)
    n_heads, n_kv = bridge.cfg.n_heads, bridge.cfg.kv_heads
    group = n_heads // n_kv
    outs = [f"blocks.0.attn.hook_{x}" for x in KINDS]
    # A QK-norm over all heads of a position (OLMo-2) mixes the heads after hook_q/hook_k.
    per_head_attention = not PATHS[family].get("qk_norm_flat")
    names = [*outs, "blocks.0.attn.hook_pattern", "blocks.0.attn.hook_z"]
    _, clean, _ = _run(bridge, ids, names)
    vec = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(2))
    for kind in KINDS:
        for target in sorted({0, _heads(bridge, kind) - 1}):
            edit = (f"blocks.0.attn.hook_{kind}_input", _add_to_head(target, vec))
            _, edited, _ = _run(bridge, ids, names, edits=[edit])
            for x, out in zip(KINDS, outs, strict=True):
                for h in range(clean[out].shape[2]):
                    same = torch.equal(edited[out][:, :, h], clean[out][:, :, h])
                    assert same is not (x == kind and h == target), (family, kind, target, out, h)
            if not per_head_attention:
                continue
            # Which query heads read it: that head for q, the kv head's group for k and v.
            readers = (
                {target} if kind == "q" else {h for h in range(n_heads) if h // group == target}
            )
            for h in range(n_heads):
                pattern = torch.equal(
                    edited["blocks.0.attn.hook_pattern"][:, h],
                    clean["blocks.0.attn.hook_pattern"][:, h],
                )
                z = torch.equal(
                    edited["blocks.0.attn.hook_z"][:, :, h], clean["blocks.0.attn.hook_z"][:, :, h]
                )
                assert pattern is (kind == "v" or h not in readers), (
                    family,
                    kind,
                    target,
                    "pattern",
                    h,
                )
                assert z is (h not in readers), (family, kind, target, "z", h)


def test_bypassed_sites_refuse_specs_while_on_and_take_them_after(
    split: TransformerBridge, ids: torch.Tensor
) -> None:
    bridge = split
    names = [f"blocks.0.{s}" for s in BYPASSED if f"blocks.0.{s}" in bridge.namespace.editable]
    assert "blocks.0.attn.hook_in" in names
    spec = [{"op": "scale", "factor": 1.5}, {"op": "add", "value": 0.25}]
    with torch.no_grad():
        before = {n: bridge(ids, intervene={n: spec}) for n in names}
        bridge.set_use_split_qkv_input(True)
        for name in names:
            with pytest.raises(SpecError, match="per-head q/k/v inputs are on") as raised:
                bridge(ids, intervene={name: spec})
            assert name in str(raised.value) and "set_use_split_qkv_input(False)" in str(
                raised.value
            )
        bridge.set_use_split_qkv_input(False)
        for name in names:
            assert torch.equal(bridge(ids, intervene={name: spec}), before[name]), name


def test_python_hook_edits_of_attn_hook_in_are_refused_while_on(
    split: TransformerBridge, ids: torch.Tensor
) -> None:
    # Attention no longer reads it: an edit there would be lost, so it is refused, not ignored.
    bridge = split
    bridge.set_use_split_qkv_input(True)
    clean, _, _ = _run(bridge, ids)
    with pytest.raises(UserError, match="per-head q/k/v inputs are on"):
        _run(bridge, ids, edits=[("blocks.0.attn.hook_in", lambda x, hook: x * 2 + 1)])
    read, _, _ = _run(bridge, ids, edits=[("blocks.0.attn.hook_in", lambda x, hook: None)])
    assert torch.equal(read, clean)


def test_turning_off_in_finally_after_an_exception_restores_the_model(
    split: TransformerBridge, ids: torch.Tensor
) -> None:
    bridge = split
    clean, _, _ = _run(bridge, ids)
    names = set(bridge.hook_dict)

    def boom(x: torch.Tensor, hook: HookPoint) -> None:
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        bridge.set_use_split_qkv_input(True)
        try:
            bridge.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_k_input", boom)])
        finally:
            bridge.set_use_split_qkv_input(False)
    assert bridge.driver.split_qkv_input is False
    assert set(bridge.hook_dict) == names
    assert sum(len(p._fwd) + len(p._bwd) for p in bridge.driver._model.hook_points.values()) == 0
    assert _no_torch_hooks(bridge)
    after, _, _ = _run(bridge, ids)
    assert torch.equal(after, clean)


# -- focused --------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_switching_off_restores_the_namespace_exactly(split: TransformerBridge) -> None:
    bridge = split
    before = bridge.namespace
    with pytest.raises(HookNameError) as raised:
        before.lookup("blocks.1.hook_v_input")
    assert "set_use_split_qkv_input(True)" in str(raised.value)
    bridge.set_use_split_qkv_input(True)
    during = bridge.namespace
    assert during.served == before.served | _sites(bridge)
    bypassed = {f"blocks.{i}.{s}" for i in range(bridge.cfg.n_layers) for s in BYPASSED}
    assert during.read_only == before.read_only | bypassed
    bridge.set_use_split_qkv_input(False)
    after = bridge.namespace
    assert (after.served, after.editable, dict(after.reasons)) == (
        before.served,
        before.editable,
        dict(before.reasons),
    )
    with pytest.raises(HookNameError) as again:
        after.lookup("blocks.1.hook_v_input")
    assert str(again.value) == str(raised.value)


@pytest.mark.parametrize("family", [f for f in PATHS if "ln1" in PATHS[f]])
def test_an_edit_of_ln1s_input_reaches_attention_either_way(
    split: TransformerBridge, ids: torch.Tensor
) -> None:
    bridge = split
    vec = torch.linspace(-1.0, 2.0, bridge.cfg.d_model)
    edit = [("blocks.0.ln1.hook_in", lambda x, hook: x + vec)]
    clean, _, _ = _run(bridge, ids)
    expected, _, _ = _run(bridge, ids, edits=edit)
    assert not torch.allclose(expected, clean)
    bridge.set_use_split_qkv_input(True)
    got, _, _ = _run(bridge, ids, edits=edit)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "falcon"])
def test_specs_edit_the_copies(split: TransformerBridge, ids: torch.Tensor) -> None:
    bridge = split
    bridge.set_use_split_qkv_input(True)
    with torch.no_grad():
        clean = bridge(ids)
        for x in KINDS:
            spec = {"op": "add", "value": 0.5, "pos": -1}
            edited = bridge(ids, intervene={f"blocks.0.hook_{x}_input": spec})
            assert not torch.equal(edited[:, -1], clean[:, -1]), x
            assert torch.equal(edited[:, :-1], clean[:, :-1]), (
                x
            )  # causal: earlier positions untouched


@pytest.mark.parametrize("family", ["llama", "gpt2", "olmo2", "gptj"])
def test_start_and_stop_at_layer_agree_with_split_on(
    split: TransformerBridge, ids: torch.Tensor
) -> None:
    bridge = split
    with torch.no_grad():
        resid = bridge(ids, stop_at_layer=1)
        tail = bridge(None, start_at_layer=1, residual=resid, tokens=ids)
        bridge.set_use_split_qkv_input(True)
        torch.testing.assert_close(bridge(ids, stop_at_layer=1), resid, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            bridge(None, start_at_layer=1, residual=resid, tokens=ids), tail, rtol=1e-6, atol=1e-6
        )
