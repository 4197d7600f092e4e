"""Worker side: the torch hooks at each physical site of vLLM's model, installed per run.

Each site reads the activation the canonical hooks name, lets ``RunState.visit`` apply the
run's edits and captures in forward order, and hands an edited value back to the model so
it propagates downstream. Only the sites some request needs are hooked, and the hooks are
removed when the run ends, so a run without captures or edits runs the bare engine.

Residual-stream sites on families with fused add-norm (``(delta, residual)`` pairs) read
``delta + residual``; an edit passes ``(edited, zeros)`` on, which the next fused add turns
back into exactly ``edited``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tl_driver_vllm._families import Layout
from tl_driver_vllm._run_state import NORMED, RunState

__all__ = ["install_sites", "normalized", "rms_scale"]


def _sub(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)  # type: ignore[assignment]
        if module is None:
            return None
    # Pipeline stages hold placeholders (nn.Identity subclasses) for other stages' modules.
    if type(module).__name__ == "PPMissingLayer":
        return None
    return module


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(mean(x^2) + eps)`` in float32, shape ``[..., 1]``."""
    return (x.float().pow(2).mean(-1, keepdim=True) + eps).sqrt()


def normalized(x: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    """The final norm's value before its weight (and bias), from its input."""
    if norm == "ln":
        return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _scale(x: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    if norm == "ln":
        return (x.float().var(-1, keepdim=True, unbiased=False) + eps).sqrt().to(x.dtype)
    return rms_scale(x, eps).to(x.dtype)


def _eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return 1e-5


class _Resid:
    """Pre-hook at the residual stream entering a layer (or the final norm)."""

    def __init__(self, state: RunState, names: tuple[str, ...], pair: bool, final: Any) -> None:
        self.state, self.names, self.pair, self.final = state, names, pair, final

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Layers take (positions, hidden, residual) on pair families, (hidden,) otherwise;
        # the final norm takes (hidden, residual) or (hidden,).
        first = 1 if self.pair and self.final is None else 0
        hidden = args[first]
        residual = args[first + 1] if self.pair and len(args) > first + 1 else None
        x = hidden if residual is None else hidden + residual
        edited = self.state.visit(self.names, x)
        if self.final is not None:
            norm, eps = self.final
            if "ln_final.hook_scale" in self.state.captured:
                self.state.capture("ln_final.hook_scale", edited, lambda t: _scale(t, norm, eps))
            if "ln_final.hook_normalized" in self.state.captured:
                self.state.capture(
                    "ln_final.hook_normalized", edited, lambda t: normalized(t, norm, eps)
                )
        if edited is x:
            return None
        new = list(args)
        new[first] = edited
        if residual is not None:
            new[first + 1] = torch.zeros_like(edited)
        return tuple(new), kwargs


class _Mid:
    """Pre-hook on the pre-MLP norm: its input is the residual between attention and MLP."""

    def __init__(self, state: RunState, name: str, pair: bool) -> None:
        self.state, self.names, self.pair = state, (name,), pair

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        if self.pair:
            x = args[0] + args[1]
            edited = self.state.visit(self.names, x)
            return None if edited is x else (edited, torch.zeros_like(edited))
        # GPT-2 style: the norm's input is also the block's `residual` variable, so an edit
        # must happen in place for the residual path to see it.
        x = args[0]
        edited = self.state.visit(self.names, x)
        if edited is not x:
            x.copy_(edited)
        return None


class _Out:
    """Forward hook on a module whose output tensor is the site (or its first element)."""

    def __init__(self, state: RunState, names: tuple[str, ...]) -> None:
        self.state, self.names = state, names

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        value = output[0] if isinstance(output, tuple) else output
        edited = self.state.visit(self.names, value)
        if edited is value:
            return None
        return (edited, *output[1:]) if isinstance(output, tuple) else edited


def install_sites(model: nn.Module, layout: Layout, n_layers: int, state: RunState) -> list[RemovableHandle]:
    """Hook every physical site that the run's captures and edits need.

    Args:
        model: vLLM's top-level ``*ForCausalLM`` module on this worker.
        layout: Where the family keeps its sites.
        n_layers: Number of decoder layers of the whole model.
        state: The run (its ``needed()`` hooks decide which sites are hooked).

    Returns:
        Handles to remove after the run.
    """
    needed = state.needed()
    inner = _sub(model, layout.inner)
    assert inner is not None
    layers = getattr(inner, layout.layers)
    handles: list[RemovableHandle] = []

    def want(*names: str) -> tuple[str, ...] | None:
        kept = tuple(n for n in names if n in needed)
        return kept or None

    def out(module: nn.Module | None, *names: str) -> None:
        kept = want(*names)
        if module is not None and kept:
            handles.append(module.register_forward_hook(_Out(state, kept)))

    if not layout.embed_scaled:
        out(_sub(inner, layout.embed), "embed.hook_out")
    if layout.pos_embed:
        out(_sub(inner, layout.pos_embed), "pos_embed.hook_out")
    final_norm = _sub(inner, layout.final_norm)
    for k in range(n_layers + 1):
        names = [f"blocks.{k - 1}.hook_out"] if k else []
        if k == 0 and layout.embed_scaled:
            # Gemma scales the embedding after its module: the embedding as it enters the
            # residual stream is block 0's input (no position embedding comes between).
            names.append("embed.hook_out")
        names.append("ln_final.hook_in" if k == n_layers else f"blocks.{k}.hook_in")
        derived = ("ln_final.hook_scale", "ln_final.hook_normalized") if k == n_layers else ()
        kept = want(*names)
        target = final_norm if k == n_layers else layers[k]
        if type(target).__name__ == "PPMissingLayer" or target is None:
            continue
        if kept or want(*derived):
            final = (layout.norm, _eps(target)) if k == n_layers else None
            hook: Callable[..., Any] = _Resid(state, kept or (), layout.residual_pair, final)
            handles.append(target.register_forward_pre_hook(hook, with_kwargs=True))
    for i in range(n_layers):
        layer = layers[i]
        if type(layer).__name__ == "PPMissingLayer":
            continue
        prefix = f"blocks.{i}."
        out(_sub(layer, layout.attn), prefix + "attn.hook_out", prefix + "ln1_post.hook_in")
        out(_sub(layer, layout.mlp), prefix + "mlp.hook_out", prefix + "ln2_post.hook_in")
        if layout.ln1_post:
            out(_sub(layer, layout.ln1_post), prefix + "ln1_post.hook_out")
        if layout.ln2_post:
            out(_sub(layer, layout.ln2_post), prefix + "ln2_post.hook_out")
        if want(prefix + "ln2.hook_in"):
            ln2 = _sub(layer, layout.ln2)
            assert ln2 is not None
            handles.append(ln2.register_forward_pre_hook(_Mid(state, prefix + "ln2.hook_in", layout.residual_pair)))
    if final_norm is not None:
        out(final_norm, "ln_final.hook_out", NORMED)
    return handles
