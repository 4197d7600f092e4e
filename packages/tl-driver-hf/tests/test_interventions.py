"""Edits and gradients: specs equal Python hooks, every edit propagates, gradients flow."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from tl_core import HookPoint, TransformerBridge, layout_of

# The family table, loaded by path (tests are imported in importlib mode).
_spec = importlib.util.spec_from_file_location("_hf_paths", Path(__file__).with_name("_paths.py"))
assert _spec is not None and _spec.loader is not None
_paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_paths)
SEQUENTIAL, PARALLEL = _paths.SEQUENTIAL, _paths.PARALLEL


def _first_block_and_global(bridge: TransformerBridge) -> list[str]:
    """Every hook that specs can edit, in block 0 and outside the blocks."""
    editable = bridge.namespace.editable
    return [
        n
        for n in bridge.hook_dict
        if n in editable and (not n.startswith("blocks.") or n.startswith("blocks.0."))
    ]


def _has_gradient(name: str) -> bool:
    # Token and position ids and chosen experts are integers; rotary tables are built from
    # positions alone; a router's weights come from its logits inside the router, so no
    # gradient passes through the logits' site.
    return layout_of(name) not in ("b p", "b p k") and not name.endswith(
        ("hook_cos", "hook_sin", "hook_router_logits")
    )


def test_spec_equals_python_hook_and_every_edit_propagates(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    # Norms ignore a rescaled input, so residual-width hooks get a non-uniform shift instead.
    shift = torch.linspace(-1.0, 2.0, bridge.cfg.d_model)
    with torch.no_grad():
        clean = bridge(ids)
        for name in _first_block_and_global(bridge):
            if layout_of(name) == "b p d":
                spec: Any = {"op": "add", "value": shift.tolist()}
                fn: Any = lambda x, hook: x + shift  # noqa: E731
            else:
                # Composed: scaling alone vanishes behind QK-norm, a shift behind softmax.
                spec = [{"op": "scale", "factor": 1.5}, {"op": "add", "value": 0.25}]
                fn = lambda x, hook: x * 1.5 + 0.25  # noqa: E731
            by_spec = bridge(ids, intervene={name: spec})
            by_hook = bridge.run_with_hooks(ids, fwd_hooks=[(name, fn)])
            torch.testing.assert_close(
                by_spec, by_hook, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
            assert (by_spec - clean).abs().max() > 1e-4, f"editing {name} did not change the logits"


def test_position_specs_only_change_later_positions(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    d_model = bridge.cfg.d_model
    vector = torch.linspace(-1, 1, d_model).tolist()
    with torch.no_grad():
        clean = bridge(ids)
        edited = bridge(
            ids, intervene={"blocks.0.hook_resid_post": {"op": "add", "value": vector, "pos": 4}}
        )
    torch.testing.assert_close(edited[:, :4], clean[:, :4])
    assert (edited[:, 4:] - clean[:, 4:]).abs().amax(dim=-1).min() > 1e-5


def test_python_hooks_can_replace_token_ids(bridge: TransformerBridge, ids: torch.Tensor) -> None:
    other = (ids + 7) % bridge.cfg.d_vocab
    with torch.no_grad():
        swapped = bridge.run_with_hooks(ids, fwd_hooks=[("hook_tokens", lambda x, hook: other)])
        torch.testing.assert_close(swapped, bridge(other))
    with pytest.raises(Exception, match="integer ids"):
        bridge(ids, intervene={"embed.hook_in": {"op": "add", "value": 1}})


@pytest.mark.parametrize("family", SEQUENTIAL)
def test_resid_mid_edit_changes_the_residual_stream(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    assert not bridge.cfg.parallel_attn_mlp
    delta = torch.randn(bridge.cfg.d_model)
    sandwich = "blocks.0.ln2_post.hook_out" in bridge.hook_dict
    sublayer = "blocks.0.ln2_post.hook_out" if sandwich else "blocks.0.mlp.hook_out"
    with torch.no_grad():
        _, clean = bridge.run_with_cache(ids, names_filter=["blocks.0.ln2.hook_in"])
        _, cache = bridge.run_with_cache(
            ids,
            names_filter=["blocks.0.ln2.hook_in", "blocks.0.hook_out", sublayer],
            intervene={"blocks.0.ln2.hook_in": lambda x, hook: x + delta},
        )
    torch.testing.assert_close(cache["blocks.0.ln2.hook_in"], clean["blocks.0.ln2.hook_in"] + delta)
    torch.testing.assert_close(
        cache["blocks.0.hook_out"],
        cache["blocks.0.ln2.hook_in"] + cache[sublayer],
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("family", PARALLEL)
def test_mlp_norm_input_of_a_parallel_block_reaches_the_mlp_only(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    assert bridge.cfg.parallel_attn_mlp
    names = [
        "blocks.0.hook_in",
        "blocks.0.attn.hook_out",
        "blocks.0.mlp.hook_out",
        "blocks.0.hook_out",
    ]
    # Served on every parallel family, the shared-norm ones (GPT-J, Falcon-7B) included.
    assert "blocks.0.ln2.hook_in" in bridge.hook_dict
    # A non-uniform shift: a LayerNorm would undo a uniform one.
    shift = torch.linspace(-1.0, 2.0, bridge.cfg.d_model)
    with torch.no_grad():
        _, clean = bridge.run_with_cache(ids, names_filter=names)
        _, edited = bridge.run_with_cache(
            ids,
            names_filter=[*names, "blocks.0.ln2.hook_in"],
            intervene={"blocks.0.hook_mlp_in": {"op": "add", "value": shift.tolist()}},
        )
    torch.testing.assert_close(edited["blocks.0.ln2.hook_in"], clean["blocks.0.hook_in"] + shift)
    # Attention and the residual stream read the unedited block input; only the MLP moves.
    torch.testing.assert_close(edited["blocks.0.attn.hook_out"], clean["blocks.0.attn.hook_out"])
    assert (edited["blocks.0.mlp.hook_out"] - clean["blocks.0.mlp.hook_out"]).abs().max() > 1e-4
    torch.testing.assert_close(
        edited["blocks.0.hook_out"],
        clean["blocks.0.hook_in"]
        + edited["blocks.0.attn.hook_out"]
        + edited["blocks.0.mlp.hook_out"],
        atol=1e-5,
        rtol=1e-5,
    )


def _weight_rule(kind: str, normalized: torch.Tensor, module: Any) -> torch.Tensor:
    if kind == "layernorm":
        return normalized * module.weight + module.bias
    if kind == "rms_plus_one":
        return normalized * (1.0 + module.weight)
    return normalized * module.weight


def test_normalized_and_scale_edits_rebuild_the_norm_output(
    paths: dict[str, Any], bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    role = "ln1" if "ln1" in paths else "ln1_post"
    prefix = f"blocks.0.{role}"
    module = bridge.driver.hf_model.get_submodule(f"{paths['layers']}.0.{paths[role]}")
    names = [
        f"{prefix}.hook_normalized",
        f"{prefix}.hook_out",
        f"{prefix}.hook_scale",
        f"{prefix}.hook_in",
    ]
    with torch.no_grad():
        _, clean = bridge.run_with_cache(ids, names_filter=names)
        _, doubled = bridge.run_with_cache(
            ids,
            names_filter=names,
            intervene={f"{prefix}.hook_normalized": {"op": "scale", "factor": 2.0}},
        )
        _, halved = bridge.run_with_cache(
            ids,
            names_filter=names,
            intervene={f"{prefix}.hook_scale": {"op": "scale", "factor": 2.0}},
        )
    expected = _weight_rule(paths["norm"], 2 * clean[f"{prefix}.hook_normalized"], module)
    torch.testing.assert_close(doubled[f"{prefix}.hook_out"], expected, atol=1e-5, rtol=1e-5)
    x = clean[f"{prefix}.hook_in"]
    if paths["norm"] == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    torch.testing.assert_close(
        halved[f"{prefix}.hook_normalized"],
        x / (2 * clean[f"{prefix}.hook_scale"]),
        atol=1e-5,
        rtol=1e-5,
    )


def _norm_value_sites(bridge: TransformerBridge) -> list[str]:
    """Every served ``hook_scale`` / ``hook_normalized`` in block 0 and outside the blocks."""
    return [
        n
        for n in bridge.hook_dict
        if n.endswith((".hook_scale", ".hook_normalized"))
        and (not n.startswith("blocks.") or n.startswith("blocks.0."))
    ]


def test_in_place_norm_edits_equal_returned_and_spec_edits(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    """TransformerLens's in-place idiom (``x[:, -1] *= 2``) takes effect at every norm site."""

    def in_place(x: torch.Tensor, hook: HookPoint) -> None:
        x[:, -1] *= 2

    def in_place_returning_x(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        x[:, -1] *= 2
        return x

    def returning_new(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        out = x.clone()
        out[:, -1] *= 2
        return out

    sites = _norm_value_sites(bridge)
    assert "ln_final.hook_scale" in sites and "ln_final.hook_normalized" in sites
    with torch.no_grad():
        clean = bridge(ids)
        for name in sites:
            by_spec = bridge(ids, intervene={name: {"op": "scale", "factor": 2.0, "pos": -1}})
            assert (by_spec - clean).abs().max() > 1e-4, f"editing {name} did not change the logits"
            for fn in (returning_new, in_place, in_place_returning_x):
                logits = bridge.run_with_hooks(ids, fwd_hooks=[(name, fn)])
                torch.testing.assert_close(
                    logits,
                    by_spec,
                    atol=1e-6,
                    rtol=1e-6,
                    msg=lambda m, n=name, f=fn: f"{n}, {f.__name__}: {m}",
                )


def test_in_place_scale_edits_keep_the_gradient(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    """The scale is saved for the backward pass, so the driver hands hooks a copy to edit."""

    def in_place(x: torch.Tensor, hook: HookPoint) -> None:
        x[:, -1] *= 2

    def returning_new(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        return torch.cat([x[:, :-1], 2 * x[:, -1:]], dim=1)

    grads: list[torch.Tensor] = []
    for fn in (in_place, returning_new):
        with bridge.hooks(
            fwd_hooks=[(n, fn) for n in _norm_value_sites(bridge) if n.endswith(".hook_scale")],
            bwd_hooks=[("embed.hook_out", lambda g, hook: grads.append(g))],
        ):
            bridge.loss(ids).backward()
        bridge.zero_grad()
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-6)


def test_gradients_reach_every_hook(bridge: TransformerBridge, ids: torch.Tensor) -> None:
    grads: dict[str, torch.Tensor] = {}

    def keep(grad: torch.Tensor, hook: HookPoint) -> None:
        grads[hook.name] = grad

    names = [n for n in bridge.hook_dict if _has_gradient(n)]
    with bridge.hooks(bwd_hooks=[(n, keep) for n in names]):
        bridge.loss(ids).backward()
    bridge.zero_grad()
    assert set(grads) == set(names)
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert grad.abs().max() > 0, name
    assert not any(p.has_backward_hooks for p in bridge.hook_dict.values())


def test_residual_gradients_match_transformers_autograd(
    bridge: TransformerBridge, reference: PreTrainedModel, ids: torch.Tensor
) -> None:
    layers = bridge.driver.adapter.layers
    seen: dict[str, torch.Tensor] = {}

    def grab(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        hidden.retain_grad()
        seen["x"] = hidden

    handle = reference.get_submodule(f"{layers}.1").register_forward_pre_hook(
        grab, with_kwargs=True
    )
    try:
        logits = reference(ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    finally:
        handle.remove()
    reference.zero_grad()
    expected = seen["x"].grad
    grads: dict[str, torch.Tensor] = {}
    with bridge.hooks(
        bwd_hooks=[("blocks.1.hook_resid_pre", lambda g, hook: grads.setdefault("g", g))]
    ):
        bridge.loss(ids).backward()
    bridge.zero_grad()
    assert expected is not None
    torch.testing.assert_close(grads["g"], expected, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("family", ["gemma2"])
def test_tl_names_resolve_against_the_model_for_capture_specs_and_cache(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    # TransformerLens's hook_attn_out is what attention adds to the residual stream: on a
    # sandwich-norm model the post-attention norm's output, not the attention module's.
    post, module = "blocks.0.ln1_post.hook_out", "blocks.0.attn.hook_out"
    assert bridge.namespace.lookup("blocks.0.hook_attn_out") == post
    with torch.no_grad():
        _, clean = bridge.run_with_cache(ids, names_filter=[post, module])
        by_alias, edited = bridge.run_with_cache(
            ids,
            names_filter=["blocks.0.hook_attn_out", module],
            intervene={"blocks.0.hook_attn_out": {"op": "scale", "factor": 0.25}},
        )
        by_name = bridge(ids, intervene={post: {"op": "scale", "factor": 0.25}})
    torch.testing.assert_close(edited[post], clean[post] * 0.25)
    torch.testing.assert_close(edited[module], clean[module])
    assert edited["blocks.0.hook_attn_out"] is edited[post]
    torch.testing.assert_close(by_alias, by_name)
    seen: list[str] = []
    bridge.run_with_hooks(
        ids, fwd_hooks=[("blocks.0.hook_attn_out", lambda x, hook: seen.append(hook.name))]
    )
    assert seen == [post]


@pytest.mark.parametrize("family", ["gptj", "falcon"])
def test_shared_norm_mlp_input_carries_the_mlp_gradient_only(
    family: str, bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    """On one-norm parallel blocks, ln2.hook_in's gradient is the MLP path's, through the norm."""
    taps: dict[str, torch.Tensor] = {}

    def tap(name: str) -> Any:
        def hook(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
            taps[name] = torch.zeros_like(x, requires_grad=True)
            return x + taps[name]

        return hook

    names = ["blocks.0.ln2.hook_in", "blocks.0.mlp.hook_in"]
    logits = bridge.run_with_hooks(ids, fwd_hooks=[(n, tap(n)) for n in names])
    logits.float().pow(2).mean().backward()
    g_site, g_mlp_in = taps[names[0]].grad, taps[names[1]].grad
    assert g_site is not None and g_mlp_in is not None and g_site.abs().max() > 0
    # The MLP input's gradient pulled back through the shared norm, and nothing else.
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids, names_filter=["blocks.0.hook_in"])
    paths = _paths.PATHS[family]
    norm = bridge.driver.hf_model.get_submodule(paths["layers"])[0].get_submodule(paths["ln1"])
    x = cache["blocks.0.hook_in"].clone().requires_grad_(True)
    (want,) = torch.autograd.grad(norm(x), x, g_mlp_in)
    torch.testing.assert_close(g_site, want, atol=1e-6, rtol=1e-5)
