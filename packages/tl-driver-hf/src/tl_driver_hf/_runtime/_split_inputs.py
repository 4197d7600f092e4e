"""Per-head q/k/v inputs on a transformers model (HookedTransformer's ``use_split_qkv_input``).

While they are on, each attention head computes its query (key, value) from its own copy
of the block input: the copy fires ``attn.hook_q_input`` (``hook_k_input``,
``hook_v_input``), is normalised by the layer's ``ln1`` module head by head, and is
projected with that head's slice of the weights. The projection modules' outputs are
replaced by the result (assembled in the module's own layout), so everything after them,
rotary and QK-norms included, runs unchanged, and a gradient at a copy is that head's
alone. The layer's normal ``ln1`` still runs (its hooks fire; in a parallel block with one
shared norm it still feeds the MLP).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tl_core import HookPoint
from tl_driver_hf._architecture._modules import LayerModules
from tl_driver_hf._weights._shapes import layer_attention_weights
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["install_split_inputs"]

_KINDS = ("q", "k", "v")


def _project(
    copies: torch.Tensor, norm: nn.Module | None, w: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """``[b, p, h, d]`` copies -> ``[b, p, h, dh]``: each head normalised and projected."""
    # The module's own forward (not __call__): the norm's tl hooks stay with its real call.
    normed = norm.forward(copies) if norm is not None else copies
    out = torch.einsum("bphd,hde->bphe", normed.to(w.dtype), w)
    return out + b.to(out.dtype)


def install_split_inputs(
    layer: LayerModules,
    points: dict[str, HookPoint | None],
    adapter: ArchitectureAdapter,
    *,
    n_heads: int,
    n_kv_heads: int,
    d_head: int,
    handles: list[RemovableHandle],
) -> None:
    """Register the hooks that give each head of ``layer`` its own input.

    Args:
        layer: The layer's modules.
        points: ``"q"``/``"k"``/``"v"`` -> the layer's ``hook_*_input`` HookPoint.
        adapter: The family's adapter (weight layout, fused layout).
        n_heads: Query heads.
        n_kv_heads: Key/value heads.
        d_head: Head size.
        handles: Where the torch handles go.
    """
    stash: dict[str, torch.Tensor] = {}
    heads = {"q": n_heads, "k": n_kv_heads, "v": n_kv_heads}

    def keep_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        stash["resid"] = args[0] if args else kwargs["hidden_states"]

    def split(kind: str, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        resid = stash["resid"]
        copies = resid[:, :, None, :].expand(-1, -1, heads[kind], -1).clone()
        point = points[kind]
        if point is not None:
            copies = point(copies)
        return _project(
            copies, layer.ln1, weights[f"W_{kind.upper()}"], weights[f"b_{kind.upper()}"]
        )

    def replace(kinds: tuple[str, ...]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
            weights = layer_attention_weights(
                layer.q,
                layer.k,
                layer.v,
                layer.qkv,
                adapter.linear,
                n_heads,
                n_kv_heads,
                d_head,
                adapter.qkv_layout,
            )
            parts = [split(kind, weights) for kind in kinds]
            if len(parts) == 1:
                fused = parts[0].flatten(-2)
            elif adapter.qkv_layout == "heads":
                fused = torch.stack(parts, dim=-2).flatten(-3)  # per head [q_h | k_h | v_h]
            else:
                fused = torch.cat([p.flatten(-2) for p in parts], dim=-1)
            return fused.to(output.dtype).reshape(output.shape)

        return hook

    # The block input: what ln1 reads after ln1.hook_in (so an edit there still reaches
    # attention, as without split). Without ln1, what attention reads before attn.hook_in:
    # that site is read-only while split is on, and an edit there must not reach the heads.
    if layer.ln1 is not None:
        handles.append(layer.ln1.register_forward_pre_hook(keep_input, with_kwargs=True))
    else:
        handles.append(
            layer.attn.register_forward_pre_hook(keep_input, with_kwargs=True, prepend=True)
        )
    if layer.qkv is not None:
        handles.append(layer.qkv.register_forward_hook(replace(_KINDS)))
        return
    for kind, module in zip(_KINDS, (layer.q, layer.k, layer.v), strict=True):
        assert module is not None
        handles.append(module.register_forward_hook(replace((kind,))))
