"""Every served hook equals a value computed independently from the plain transformers model.

The reference side never uses the driver: plain torch hooks on the eager model's modules
(located by this file's own table of module paths), an attention function registered by
this test that records q/k/v and delegates to the family's own eager code, and formulas
written out here (norm scales, scores, per-head results).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from tl_core import TransformerBridge

# Tests are imported in importlib mode, so the sibling helper is loaded by path.
_spec = importlib.util.spec_from_file_location(
    "_hf_inline_reference", Path(__file__).with_name("_inline_reference.py")
)
assert _spec is not None and _spec.loader is not None
_inline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_inline)
record_inline_attention = _inline.record_inline_attention

_RECORD: dict[int, dict[str, torch.Tensor]] = {}


def _record_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(module, query, key, value, *args, **kwargs)
    _RECORD[id(module)] = {"q": query, "k": key, "v": value, "pattern": weights, "z": out}
    return out, weights


AttentionInterface.register("test_record", _record_attention)
AttentionMaskInterface.register("test_record", eager_mask)


def _scale_and_normalized(
    x: torch.Tensor, module: nn.Module, layernorm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    eps = next(getattr(module, n) for n in ("variance_epsilon", "eps") if hasattr(module, n))
    x = x.float()
    if layernorm:
        x = x - x.mean(-1, keepdim=True)
    scale = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return scale, x / scale


def _heads(x: torch.Tensor, d_head: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, d_head))


def reference_values(
    paths: dict[str, Any], model: PreTrainedModel, ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Every canonical hook's value, computed from the plain model located by ``paths``."""
    config = model.config
    d_head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_heads = config.num_attention_heads
    n_kv = paths.get("n_kv") or getattr(config, "num_key_value_heads", None) or n_heads
    layernorm = paths["norm"] == "layernorm"
    values: dict[str, torch.Tensor] = {}
    handles = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            values[name] = (args[0] if args else kwargs["hidden_states"]).detach()

        return hook

    def post(
        name: str, split: tuple[str, ...] = (), sizes: tuple[int, ...] = (), heads: bool = False
    ) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            out = out[0] if isinstance(out, tuple) else out
            parts = out.split(sizes, dim=-1) if split else (out,)
            for part_name, part in zip(split or (name,), parts, strict=True):
                if part_name:
                    # A copy: Falcon adds into its MLP output in place afterwards.
                    values[part_name] = (_heads(part, d_head) if heads else part).detach().clone()

        return hook

    def per_head(names: tuple[str, str]) -> Callable[..., None]:
        # GPT-NeoX views its fused projection as [..., heads, 3 * d_head]: q, k, v per head.
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            q, k, _ = out.unflatten(-1, (n_heads, 3 * d_head)).chunk(3, dim=-1)
            values[names[0]], values[names[1]] = q.detach(), k.detach()

        return hook

    def norm(
        prefix: str, module: nn.Module, heads: int | None = None, heads_first: bool = False
    ) -> None:
        # heads: the norm sees all heads of a position flat (OLMo 2's QK-norm); tl serves
        # its sites per head, the scale repeated for every head. heads_first: the norm sees
        # [b, h, p, dh] (Gemma 3); tl serves [b, p, h, dh].
        def hook(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            scale, normalized = _scale_and_normalized(args[0], mod, layernorm)
            x, out = args[0].detach(), out.detach()
            if heads is not None:
                x, out, normalized = (_heads(v, d_head) for v in (x, out, normalized))
                scale = scale[..., None, :].expand(*scale.shape[:-1], heads, 1)
            if heads_first:
                x, out, normalized, scale = (v.transpose(1, 2) for v in (x, out, normalized, scale))
            values[f"{prefix}.hook_in"] = x
            values[f"{prefix}.hook_scale"] = scale
            values[f"{prefix}.hook_normalized"] = normalized
            values[f"{prefix}.hook_out"] = out

        handles.append(module.register_forward_hook(hook))

    def routing(prefix: str) -> Callable[..., None]:
        # The router sees flattened positions; its top-k weights spread over all experts.
        def hook(module: nn.Module, args: tuple[Any, ...], out: tuple[torch.Tensor, ...]) -> None:
            logits, weights, chosen = (v.detach() for v in out)
            dense = torch.zeros_like(logits)
            for row in range(logits.shape[0]):
                dense[row, chosen[row]] = weights[row]
            for name, value in (
                ("router_logits", logits),
                ("expert_weights", dense),
                ("expert_indices", chosen),
            ):
                values[f"{prefix}hook_{name}"] = value.unflatten(0, tuple(ids.shape))

        return hook

    def table(prefix: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # Without explicit position ids the model builds one row for the whole batch.
            cos, sin = (
                v.detach().expand(ids.shape[0], -1, -1) for v in kwargs["position_embeddings"]
            )
            values[prefix + "hook_cos"], values[prefix + "hook_sin"] = cos, sin

        return hook

    get = model.get_submodule
    values["embed.hook_in"] = ids
    # The embedding module's own output: Gemma's scales its lookup by sqrt(d_model).
    handles.append(get(paths["embed"]).register_forward_hook(post("embed.hook_out")))
    if "embed_norm" in paths:
        norm("embed_ln", get(paths["embed_norm"]))
    if "pos" in paths:
        positions = torch.arange(ids.shape[1])
        values["pos_embed.hook_in"] = positions.expand(*ids.shape)
        values["pos_embed.hook_out"] = (
            get(paths["pos"]).weight[positions + paths.get("pos_offset", 0)].expand(*ids.shape, -1)
        )
    layers = get(paths["layers"])
    attn_modules = []
    for i, layer in enumerate(layers):
        b = f"blocks.{i}."
        handles.append(layer.register_forward_pre_hook(pre(b + "hook_in"), with_kwargs=True))
        if paths.get("parallel") and "ln2" not in paths and "ln1" in paths:
            # One norm for both sublayers: the MLP's norm input is the block input.
            handles.append(
                layer.register_forward_pre_hook(pre(b + "ln2.hook_in"), with_kwargs=True)
            )
        handles.append(layer.register_forward_hook(post(b + "hook_out")))
        attn = layer.get_submodule(paths["attn"])
        attn_modules.append(attn)
        handles.append(attn.register_forward_pre_hook(pre(b + "attn.hook_in"), with_kwargs=True))
        # BLOOM's attention module returns output + residual: its contribution is "dense".
        handles.append(
            attn.get_submodule(paths.get("attn_out", "")).register_forward_hook(
                post(b + "attn.hook_out")
            )
        )
        if "inline" in paths:
            o_proj = attn.get_submodule(paths["o"])
            handles.extend(
                record_inline_attention(paths["inline"], attn, o_proj, n_heads, d_head, _RECORD)
            )
        handles.append(
            attn.get_submodule(paths["o"]).register_forward_pre_hook(
                pre(b + "o_in"), with_kwargs=True
            )
        )
        # Rotary and pre-scaled (OPT) families: hook_q/hook_k are the projections' outputs.
        at_projection = paths["rotary"] or paths.get("prescaled", False)
        qk = ("hook_q", "hook_k") if at_projection else ("", "")
        if "qkv" in paths and paths.get("qkv_per_head"):
            names = (b + "attn.hook_q", b + "attn.hook_k")
            handles.append(attn.get_submodule(paths["qkv"]).register_forward_hook(per_head(names)))
        elif "qkv" in paths:
            names = (b + "attn." + qk[0] if qk[0] else "", b + "attn." + qk[1] if qk[1] else "", "")
            sizes = (n_heads * d_head, n_kv * d_head, n_kv * d_head)
            handles.append(
                attn.get_submodule(paths["qkv"]).register_forward_hook(
                    post("", names, sizes, heads=True)
                )
            )
        else:
            for role in ("q", "k") if at_projection else ():
                handles.append(
                    attn.get_submodule(paths[role]).register_forward_hook(
                        post(f"{b}attn.hook_{role}", heads=True)
                    )
                )
        for role in ("ln1", "ln2", "ln1_post", "ln2_post"):
            if role in paths:
                norm(b + role, layer.get_submodule(paths[role]))
        for role, heads in (("q_norm", n_heads), ("k_norm", n_kv)):
            if role in paths:
                flat = heads if paths.get("qk_norm_flat") else None
                first = bool(paths.get("qk_norm_heads_first"))
                norm(f"{b}attn.{role}", attn.get_submodule(paths[role]), flat, first)
        if paths.get("rotary_table"):
            handles.append(attn.register_forward_pre_hook(table(b + "attn."), with_kwargs=True))
        mlp = layer.get_submodule(paths["mlp"])
        # OPT's MLP projections sit in the layer itself (there is no MLP module).
        mlp_first = mlp.get_submodule(paths["pre"]) if paths.get("mlp_inline") else mlp
        mlp_last = mlp.get_submodule(paths["down"]) if paths.get("mlp_inline") else mlp
        if "ln2" not in paths and not paths.get("parallel"):
            handles.append(mlp.register_forward_pre_hook(pre(b + "ln2.hook_in"), with_kwargs=True))
        handles.append(
            mlp_first.register_forward_pre_hook(pre(b + "mlp.hook_in"), with_kwargs=True)
        )
        handles.append(
            mlp_last.get_submodule(paths.get("mlp_out", "")).register_forward_hook(
                post(b + "mlp.hook_out")
            )
        )
        if "gate_up" in paths:
            size = config.intermediate_size
            handles.append(
                mlp.get_submodule(paths["gate_up"]).register_forward_hook(
                    post("", (b + "mlp.hook_pre", b + "mlp.hook_pre_linear"), (size, size))
                )
            )
        for role in ("pre", "pre_linear"):
            if role in paths:
                handles.append(
                    mlp.get_submodule(paths[role]).register_forward_hook(
                        post(f"{b}mlp.hook_{role}")
                    )
                )
        if "router" in paths:
            handles.append(
                mlp.get_submodule(paths["router"]).register_forward_hook(routing(b + "mlp."))
            )
        if "down" in paths or "gate_up" in paths:
            handles.append(
                mlp.get_submodule(paths.get("down", "down_proj")).register_forward_pre_hook(
                    pre(b + "mlp.hook_post"), with_kwargs=True
                )
            )
    norm("ln_final", get(paths["final"]))
    handles.append(get(paths["head"]).register_forward_hook(post("unembed.hook_out")))
    saved = model.config._attn_implementation
    model.set_attn_implementation("test_record")
    try:
        with torch.no_grad():
            values["logits"] = model(ids).logits
    finally:
        model.set_attn_implementation(saved)
        for handle in handles:
            handle.remove()
    if paths.get("flat_mlp"):
        # OPT flattens batch and position before its MLP half.
        for name, value in values.items():
            if value.dim() == 2 and value.shape[0] == ids.numel():
                values[name] = value.unflatten(0, tuple(ids.shape))
    for i, attn in enumerate(attn_modules):
        b = f"blocks.{i}.attn."
        rec = _RECORD.pop(id(attn))
        rot = "rot_" if paths["rotary"] else ""
        if rot or not paths.get("prescaled"):  # OPT's attention receives q already scaled
            values[b + f"hook_{rot}q"] = rec["q"].transpose(1, 2)
            values[b + f"hook_{rot}k"] = rec["k"].transpose(1, 2)
        values[b + "hook_v"] = rec["v"].transpose(1, 2)
        values[b + "hook_pattern"] = rec["pattern"]
        values[b + "hook_z"] = rec["z"]
        group = n_heads // n_kv
        scores = (
            rec["scores"]
            if "scores" in rec
            else rec["q"]
            @ rec["k"].repeat_interleave(group, dim=1).transpose(-1, -2)
            * (1.0 if paths.get("prescaled") else attn.scaling)
        )
        cap = getattr(config, "attn_logit_softcapping", None)
        if cap:
            scores = torch.tanh(scores / cap) * cap
        seq = ids.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        values[b + "hook_attn_scores"] = scores.masked_fill(~causal, float("-inf"))
        o = attn.get_submodule(paths["o"])
        w_o = o.weight if paths.get("conv1d") else o.weight.T
        z = values.pop(f"blocks.{i}.o_in").unflatten(-1, (n_heads, d_head))
        values[b + "hook_result"] = torch.einsum(
            "bphe,hed->bphd", z, w_o.unflatten(0, (n_heads, d_head))
        )
    return values


def test_logits_match_eager_transformers(
    family: str, bridge: TransformerBridge, reference: PreTrainedModel, ids: torch.Tensor
) -> None:
    with torch.no_grad():
        expected = reference(ids).logits
        fast = bridge(ids)  # no attention hooks: the SDPA fast path
        explicit = bridge.run_with_hooks(
            ids, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda x, hook: None)]
        )
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit, expected, atol=1e-5, rtol=1e-5)


def test_block_outputs_match_hidden_states(
    family: str, bridge: TransformerBridge, reference: PreTrainedModel, ids: torch.Tensor
) -> None:
    with torch.no_grad():
        hidden = reference(ids, output_hidden_states=True).hidden_states
        _, cache = bridge.run_with_cache(
            ids, names_filter=lambda n: n.endswith("hook_out") or n.endswith("hook_in")
        )
    n_layers = bridge.cfg.n_layers
    for i in range(n_layers):
        torch.testing.assert_close(cache[f"blocks.{i}.hook_in"], hidden[i], atol=1e-5, rtol=1e-5)
    for i in range(n_layers - 1):
        torch.testing.assert_close(
            cache[f"blocks.{i}.hook_out"], hidden[i + 1], atol=1e-5, rtol=1e-5
        )
    # transformers' last hidden state is after the final norm.
    torch.testing.assert_close(cache["ln_final.hook_out"], hidden[-1], atol=1e-5, rtol=1e-5)


def test_every_served_hook_equals_an_independent_value(
    paths: dict[str, Any], bridge: TransformerBridge, reference: PreTrainedModel, ids: torch.Tensor
) -> None:
    expected = reference_values(paths, reference, ids)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
    torch.testing.assert_close(logits, expected.pop("logits"), atol=1e-5, rtol=1e-5)
    served = set(bridge.hook_dict)
    assert served == set(expected), (sorted(served - set(expected)), sorted(set(expected) - served))
    for name in sorted(served):
        got, want = cache[name], expected[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        torch.testing.assert_close(
            got.float(), want.float(), atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_non_fireable_hooks_say_why(family: str, bridge: TransformerBridge) -> None:
    reasons = bridge.driver.non_fireable_reasons
    assert not set(reasons) & set(bridge.hook_dict)
    for name, reason in reasons.items():
        assert reason and len(reason) > 20, name
    if family == "mixtral":
        assert "expert" in reasons["blocks.0.mlp.hook_post"]
    if family == "olmo2":
        assert "no norm before attention" in reasons["blocks.1.ln1.hook_scale"]
    if family == "gpt2":
        assert "rotary" in reasons["blocks.0.attn.hook_rot_q"]
    if family == "gptj":
        assert "one norm per block" in reasons["blocks.0.ln2.hook_out"]
    # A site the model's structure lacks is refused as absent; a site the family lacks
    # despite its structure (a quirk the adapter declares) with the adapter's reason.
    for name, reason in reasons.items():
        absent = bridge.namespace.resolve(name).status == "structurally_absent"
        with pytest.raises(
            Exception, match="structurally absent" if absent else "cannot fire"
        ) as info:
            bridge.run_with_cache("x", names_filter=[name])
        assert absent or reason in str(info.value)


def test_every_served_hook_has_its_canonical_layout(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    """Shapes follow the vocabulary's layout whatever the family's own layout is."""
    namespace = bridge.namespace
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    batch, pos = ids.shape
    for name in namespace.served:
        shape = namespace.feature_shape(name)
        # Attention scores and patterns are [b, h, q, k]; everything else [b, p, ...].
        expected = (batch, bridge.cfg.n_heads, pos, pos) if shape is None else (batch, pos, *shape)
        assert tuple(cache[name].shape) == expected, name


def test_driver_keeps_the_contract(bridge: TransformerBridge) -> None:
    from tl_core.driver_api import check_driver

    check_driver(bridge.driver)
