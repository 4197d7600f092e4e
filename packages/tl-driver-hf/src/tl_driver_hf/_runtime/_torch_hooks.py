"""The torch hooks the hf driver's wiring installs: each fires a HookPoint on a module's
input or output and hands an edited tensor downstream.

Factories only (no state of their own beyond ``ForwardBookkeeping``, the per-forward bookkeeping);
``tl_driver_hf._runtime._wiring.Wiring`` decides which of them to install where.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from tl_core import HookPoint, UserError
from tl_core.driver_api import centred_input
from tl_driver_hf._runtime._arena import CaptureArena
from tl_driver_hf._runtime._norms import apply_weight, norm_eps, normalize

__all__ = [
    "HeadView",
    "ROUTER_LOGITS_READ_ONLY",
    "ForwardBookkeeping",
    "_heads_hook",
    "_ids_hook",
    "_input_hook",
    "_input_of",
    "_norm_hook",
    "_output_hook",
    "_per_head_split_hook",
    "_rotary_hook",
    "_router_hook",
    "_shape_hook",
    "_shared_norm_mlp_hook",
    "_split_hook",
    "_stash_input_hook",
    "_viewed_input_hook",
    "_weight",
    "_with_input",
]


class ForwardBookkeeping:
    """Per-forward bookkeeping: residual edits made at ``resid_mid`` awaiting the block end."""

    def __init__(self) -> None:
        self.resid_mid_delta: dict[int, torch.Tensor] = {}
        # Batch and position shape of each layer's input (layers that flatten them, OPT).
        self.shapes: dict[int, tuple[int, ...]] = {}
        # Each shared-norm layer's input, for the MLP's copy of that norm (GPT-J, Falcon-7B).
        self.block_inputs: dict[int, torch.Tensor] = {}


def _input_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]  # type: ignore[no-any-return]


def _with_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], new: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (new, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": new}


def _input_hook(point: HookPoint) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = _input_of(args, kwargs)
        out = point(x)
        return None if out is x else _with_input(args, kwargs, out)

    return hook


def _stash_input_hook(i: int, state: ForwardBookkeeping) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state.block_inputs[i] = _input_of(args, kwargs)

    return hook


def _shared_norm_mlp_hook(
    i: int, norm: nn.Module, point: HookPoint, state: ForwardBookkeeping
) -> Callable[..., Any]:
    """The MLP reads ``norm(ln2.hook_in)`` instead of the shared norm's output.

    ``norm.forward`` on the unedited block input gives the shared norm's output bit for bit
    (the same module, called without its hooks), so the forward is unchanged; gradients and
    edits at ``ln2.hook_in`` then reach the MLP only, as TransformerLens's copy of the norm
    (``ln2`` = ``ln1``'s weights) does.
    """

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = state.block_inputs.pop(i)
        return _with_input(args, kwargs, norm.forward(point(x)))

    return hook


def _output_hook(point: HookPoint, *, copy: bool = False) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        x = output[0] if isinstance(output, tuple) else output
        out = point(x)
        if copy:
            # The caller then writes into this tensor in place (Falcon's MLP output).
            out = out.clone()
        if out is x:
            return None
        return (out, *output[1:]) if isinstance(output, tuple) else out

    return hook


def _heads_hook(point: HookPoint, n_heads: int, d_head: int) -> Callable[..., Any]:
    """Fire a ``b p h dh`` hook on a projection's ``b p (h dh)`` output."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        seen = torch.unflatten(output, -1, (n_heads, d_head))
        out = point(seen)
        # Backward hooks sit on ``seen``, so it must stay in the graph when there are any.
        return None if out is seen and not point.has_backward_hooks else out.flatten(-2)

    return hook


def _split_hook(
    points: tuple[HookPoint | None, ...],
    sizes: tuple[int, ...],
    heads: tuple[int, ...] | None,
    d_head: int,
) -> Callable[..., Any]:
    """Fire hooks on the parts of a fused projection (``[q | k | v]`` or ``[gate | up]``)."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        parts = list(torch.split(output, list(sizes), dim=-1))
        changed = False
        for index, point in enumerate(points):
            if point is None or not point.has_hooks:
                continue
            part = parts[index]
            seen = torch.unflatten(part, -1, (heads[index], d_head)) if heads else part
            out = point(seen)
            if out is not seen or point.has_backward_hooks:
                parts[index] = out.flatten(-2) if heads else out
                changed = True
        return torch.cat(parts, dim=-1) if changed else None

    return hook


def _per_head_split_hook(
    points: tuple[HookPoint | None, ...], n_heads: int, d_head: int
) -> Callable[..., Any]:
    """Fire ``b p h dh`` hooks on a fused projection laid out per head ``[q_h | k_h | v_h]``."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        fused = torch.unflatten(output, -1, (n_heads, len(points), d_head))
        parts = list(fused.unbind(-2))
        changed = False
        for index, point in enumerate(points):
            if point is None or not point.has_hooks:
                continue
            out = point(parts[index])
            if out is not parts[index] or point.has_backward_hooks:
                parts[index] = out
                changed = True
        return torch.stack(parts, dim=-2).flatten(-3) if changed else None

    return hook


ROUTER_LOGITS_READ_ONLY = (
    "the router picks the experts from its logits in the same call, so an edit of the "
    "logits would not re-route; edit blocks.{i}.mlp.hook_expert_weights to reweight experts"
)


def _router_hook(
    logits: HookPoint | None,
    weights: HookPoint | None,
    indices: HookPoint | None,
    i: int,
    state: ForwardBookkeeping,
) -> Callable[..., Any]:
    """Fire the routing hooks on a router's ``(logits, top-k weights, top-k indices)``.

    The router works on flattened positions; the hooks see ``[batch, pos, ...]``. Expert
    weights are served per expert (0 where not chosen) and an edit of them is gathered back
    into the weights the experts are mixed with.
    """

    def hook(module: nn.Module, args: tuple[Any, ...], output: tuple[Any, ...]) -> Any:
        router_logits, top_weights, top_indices = output
        shape = state.shapes[i]
        for point, value in ((logits, router_logits), (indices, top_indices)):
            if point is not None and point.has_hooks:
                seen = torch.unflatten(value, 0, shape)
                if point(seen) is not seen:
                    raise UserError(
                        f"a hook on {point.name!r} returned a new value, but the site is "
                        f"read-only: {ROUTER_LOGITS_READ_ONLY.format(i=i)}"
                    )
        if weights is None or not weights.has_hooks:
            return None
        dense = torch.zeros(
            router_logits.shape, dtype=top_weights.dtype, device=top_weights.device
        ).scatter(1, top_indices, top_weights)
        seen = torch.unflatten(dense, 0, shape)
        out = weights(seen)
        if out is seen and not weights.has_backward_hooks:
            return None
        return router_logits, out.flatten(0, len(shape) - 1).gather(1, top_indices), top_indices

    return hook


def _shape_hook(i: int, state: ForwardBookkeeping) -> Callable[..., Any]:
    """Record a layer's batch and position shape (for layers that flatten them)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state.shapes[i] = tuple(_input_of(args, kwargs).shape[:-1])

    return hook


def _weight(module: nn.Module) -> torch.Tensor:
    return cast(torch.Tensor, module.weight)


def _has_bwd(*points: HookPoint | None) -> bool:
    return any(p is not None and p.has_backward_hooks for p in points)


def _ids_hook(point: HookPoint, kwarg: str) -> Callable[..., Any]:
    """Fire a hook on the integer ids a module takes (as ``kwarg`` or first argument)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get(kwarg) is not None:
            ids = kwargs[kwarg]
            out = point(ids)
            return None if out is ids else (args, {**kwargs, kwarg: out})
        ids = args[0]
        out = point(ids)
        return None if out is ids else ((out, *args[1:]), kwargs)

    return hook


def _rotary_hook(cos: HookPoint | None, sin: HookPoint | None) -> Callable[..., Any]:
    """Fire ``attn.hook_cos``/``hook_sin`` on the table attention receives, ``[b, p, r]``."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        table = kwargs.get("position_embeddings")
        if not isinstance(table, (tuple, list)) or len(table) != 2:
            return None
        old = tuple(table)
        new = tuple(
            point(value) if point is not None and point.has_hooks else value
            for point, value in zip((cos, sin), old, strict=True)
        )
        if all(a is b for a, b in zip(new, old, strict=True)):
            return None
        return args, {**kwargs, "position_embeddings": new}

    return hook


class HeadView:
    """How a QK-norm's tensors are laid out relative to tl's ``b p h dh``.

    ``"positions_first"`` (Qwen3) is tl's own layout; ``"heads_first"`` (Gemma 3) norms a
    ``b h p dh`` tensor; ``"flat"`` (OLMo 2) norms the flat projection ``b p (h dh)``, one
    scale per position, which tl serves repeated for every head.
    """

    def __init__(self, layout: str, heads: int) -> None:
        self.layout, self.heads = layout, heads

    def to_tl(self, x: torch.Tensor) -> torch.Tensor:
        """The model's tensor in tl's layout (a view)."""
        if self.layout == "heads_first":
            return x.transpose(1, 2)
        if self.layout == "flat":
            return torch.unflatten(x, -1, (self.heads, x.shape[-1] // self.heads))
        return x

    def to_model(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor in tl's layout back in the model's."""
        if self.layout == "heads_first":
            return x.transpose(1, 2)
        if self.layout == "flat":
            return x.flatten(-2)
        return x

    def scale_to_tl(self, s: torch.Tensor) -> torch.Tensor:
        """The norm's ``[..., 1]`` scale in tl's ``b p h 1`` layout."""
        if self.layout == "flat":
            return s.unsqueeze(-2).expand(*s.shape[:-1], self.heads, 1).contiguous()
        return self.to_tl(s)


def _viewed_input_hook(point: HookPoint, view: HeadView) -> Callable[..., Any]:
    """Fire a ``b p h dh`` hook on a norm input laid out the model's way."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = _input_of(args, kwargs)
        seen = view.to_tl(x)
        out = point(seen)
        if out is seen and not point.has_backward_hooks:
            return None
        return _with_input(args, kwargs, view.to_model(out))

    return hook


def _norm_hook(
    kind: Any,
    scale: HookPoint | None,
    normed: HookPoint | None,
    out: HookPoint | None,
    view: HeadView | None = None,
    arena: CaptureArena | None = None,
) -> Callable[..., Any]:
    """Fire a norm's scale, normalized and output hooks; rebuild the output after edits.

    With a ``view`` (QK-norms) the hooks fire in tl's per-head layout whatever layout the
    model normalises in. Without one, a hooked normalized value of an RMS norm's float32
    input is written into an ``arena`` buffer (a LayerNorm's comes fastest from the fused
    kernel's own fresh output).
    """

    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        result = output
        if (scale is not None and scale.has_hooks) or (normed is not None and normed.has_hooks):
            x = args[0]
            into = None
            if arena is not None and view is None and normed is not None and normed.has_hooks:
                rms = kind != "layernorm" and x.dtype == torch.float32
                into = arena.empty(x.shape, x) if rms else None
            s, n = normalize(x, kind, norm_eps(module), out=into)
            if view is not None:
                s, n = view.scale_to_tl(s), view.to_tl(n)
            new_s, s_in_place = _fire(scale, s)
            s_edited = s_in_place or new_s is not s
            if s_edited or _has_bwd(scale):
                # Only an edited scale (or its gradient) needs the centred input.
                c = centred_input(x, kind)
                n = (c if view is None else view.to_tl(c)) / new_s
            new_n, n_in_place = _fire(normed, n)
            if s_edited or n_in_place or new_n is not n or _has_bwd(scale, normed):
                weighted = new_n if view is None else view.to_model(new_n)
                result = apply_weight(weighted, module, kind, x.dtype)
                if not (s_in_place or n_in_place) and _same(new_n, n) and _same(new_s, s):
                    # Only the gradient changes (backward hooks, relevance rules, probes that
                    # add zero): keep the module's own bits, route the gradient through the
                    # rebuilt value, which differs from a fused LayerNorm by rounding.
                    result = output.detach() + (result - result.detach())
        if out is not None and out.has_hooks:
            seen = result if view is None else view.to_tl(result)
            edited = out(seen)
            if edited is not seen or (view is not None and out.has_backward_hooks):
                result = edited if view is None else view.to_model(edited)
        return None if result is output else result

    return hook


def _fire(point: HookPoint | None, value: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``point(value)``, and whether its hooks wrote into ``value`` in place.

    ``value`` is the norm's recomputed scale or normalized value, the driver's own tensor, so
    hooks may edit it in place as TransformerLens's ``x[:, -1] = 0`` idiom does; the version
    counter, which every in-place write bumps (views share it), detects that at no cost.
    Tensors made under ``torch.inference_mode`` keep no version counter: their values are
    compared with a copy taken before the hooks ran.
    """
    if point is None or not point.has_hooks:
        return value, False
    if value.is_inference():
        before = value.clone()
        out = point(value)
        return out, not torch.equal(before, value)
    version = value._version
    out = point(value)
    return out, value._version != version


def _same(edited: torch.Tensor, original: torch.Tensor) -> bool:
    """Whether a hook handed on the value it got (the same object, or equal bits)."""
    return edited is original or torch.equal(edited, original)
