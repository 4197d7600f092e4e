"""Hooks for block shapes beyond Llama's: MLP inputs without a norm of their own, shared norms,
the Transformers backend's batch axis and its ``Attention`` calls, and activation fixes.

* ``ResidualInput``: ``ln2.hook_in`` where no norm sits before the MLP (OLMo 2). The MLP
  reads the residual stream itself, which the block also keeps as its ``residual``, so an
  edit happens in place, as on the other unfused families.
* ``SharedNormInput``: ``ln2.hook_in`` where one norm feeds attention and the MLP (GPT-J,
  Falcon-7B). The value is the block input as the MLP's norm reads it. In a run that reads
  or edits it, the MLP reads its own copy of the shared norm, ``norm(ln2.hook_in)``
  computed by the norm module's own ``forward`` (bit for bit the shared norm's output when
  nothing is edited), as the hf driver does: an edit there reaches the MLP only, and edits
  of ``ln1.*`` reach attention only.
* ``Unbatched``: vLLM's Transformers backend hands tensors on as ``[1, tokens, ...]``; this
  adapter shows a site hook ``[tokens, ...]`` views (in-place edits reach the original) and
  puts the axis back on values it replaces.
* ``CallThrough``: the Transformers backend calls vLLM's ``Attention`` through its
  ``forward`` method, which skips module hooks; for one run the method is wrapped (an
  instance attribute, removed with the run's other hooks) so a pre-hook still sees its
  ``(query, key, value)``.
* ``install_activations``: where vLLM's model computes another MLP activation than the
  checkpoint defines (``Layout.activation``), the checkpoint's is installed at boot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tl_driver_vllm._worker_side._run_state import RunState

__all__ = ["CallThrough", "ResidualInput", "SharedNormInput", "Unbatched", "install_activations"]

_MISSING = object()


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> torch.Tensor:
    value = kwargs.get("hidden_states") if len(args) <= index else args[index]
    assert isinstance(value, torch.Tensor), "the module got no hidden states"
    return value


class ResidualInput:
    """Pre-hook on an MLP that reads the residual stream directly: edits in place."""

    def __init__(self, state: RunState, name: str) -> None:
        self.state, self.names = state, (name,)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = _hidden(args, kwargs, 0)
        edited = self.state.visit(self.names, x)
        if edited is not x:
            x.copy_(edited)


class SharedNormInput:
    """``ln2.hook_in`` of a parallel block whose one norm feeds both sublayers.

    Args:
        state: The run.
        name: The hook (``blocks.{i}.ln2.hook_in``).
        norm: The shared norm module (``ln1``).
        index: Position of the hidden states among the layer's arguments.
    """

    def __init__(self, state: RunState, name: str, norm: nn.Module, index: int) -> None:
        self.state, self.names, self.norm, self.index = state, (name,), norm, index
        self.block_input: torch.Tensor | None = None

    def keep(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Layer pre-hook (after the residual sites'): remember the block input."""
        self.block_input = _hidden(args, kwargs, self.index)

    def mlp(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """MLP pre-hook: read (and edit) the block input; the MLP gets its norm."""
        x, self.block_input = self.block_input, None
        assert x is not None, "the layer's pre-hook did not run before its MLP"
        edited = self.state.visit(self.names, x)
        # forward(), not __call__: the norm's own hooks (ln1.*) fire once, for attention.
        normed = self.norm.forward(edited)
        if args:
            return (normed, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": normed}


def _squeeze(value: Any) -> tuple[Any, bool]:
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1:
        return value[0], True
    return value, False


def _restore(value: Any, squeezed: bool) -> Any:
    return value.unsqueeze(0) if squeezed and isinstance(value, torch.Tensor) else value


class Unbatched:
    """Adapter showing a site hook tensors without the Transformers backend's batch axis.

    A forward hook sees its module's arguments and output that way, a pre-hook its
    arguments (and ``hidden_states=``).

    Args:
        hook: A forward hook ``(module, args, output)`` (``kind="forward"``) or pre-hook
            ``(module, args)`` (``"pre"``) or ``(module, args, kwargs)`` (``"pre_kwargs"``).
        kind: Which of the three it is.
    """

    def __init__(self, hook: Callable[..., Any], kind: str) -> None:
        self.hook, self.kind = hook, kind

    def __call__(self, module: nn.Module, *rest: Any) -> Any:
        if self.kind == "forward":
            args, output = rest
            first = output[0] if isinstance(output, tuple) else output
            value, squeezed = _squeeze(first)
            shown = (value, *output[1:]) if isinstance(output, tuple) else value
            new = self.hook(module, tuple(_squeeze(a)[0] for a in args), shown)
            if new is None:
                return None
            head = _restore(new[0] if isinstance(new, tuple) else new, squeezed)
            return (head, *new[1:]) if isinstance(new, tuple) else head
        pairs = [_squeeze(a) for a in rest[0]]
        args = tuple(v for v, _ in pairs)
        if self.kind == "pre":
            new = self.hook(module, args)
            if new is None:
                return None
            return tuple(_restore(v, s) for v, (_, s) in zip(new, pairs, strict=False))
        kwargs = rest[1]
        hidden, hidden_squeezed = _squeeze(kwargs.get("hidden_states"))
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": hidden}
        new = self.hook(module, args, kwargs)
        if new is None:
            return None
        new_args, new_kwargs = new
        new_args = tuple(_restore(v, s) for v, (_, s) in zip(new_args, pairs, strict=False))
        if "hidden_states" in new_kwargs:
            new_kwargs = {
                **new_kwargs,
                "hidden_states": _restore(new_kwargs["hidden_states"], hidden_squeezed),
            }
        return new_args, new_kwargs


class CallThrough:
    """Run a ``(module, args, kwargs)`` pre-hook on calls to ``module.forward`` itself.

    Behaves as a hook handle: ``remove()`` puts the module's ``forward`` back.
    """

    def __init__(self, module: nn.Module, hook: Callable[..., Any]) -> None:
        self.module = module
        self.saved = vars(module).get("forward", _MISSING)
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            new = hook(module, args, kwargs)
            if new is not None:
                args, kwargs = new
            return original(*args, **kwargs)

        vars(module)["forward"] = forward

    def remove(self) -> None:
        """Restore the module's own ``forward``."""
        if self.saved is _MISSING:
            vars(self.module).pop("forward", None)
        else:
            vars(self.module)["forward"] = self.saved


def install_activations(
    layers: Any, mlp: str, activation: Sequence[str] | None, n_layers: int
) -> int:
    """Give each MLP the checkpoint's activation where vLLM's model uses another one.

    Args:
        layers: The model's ``ModuleList`` of decoder layers on this worker.
        mlp: The MLP's path in a layer (``Layout.mlp``).
        activation: ``(path in the MLP, activation name)`` (``Layout.activation``), or
            ``None`` when the checkpoint's activation is vLLM's.
        n_layers: Number of decoder layers.

    Returns:
        How many MLPs got the activation (0 when the layout needs none).
    """
    if activation is None:
        return 0
    from vllm.model_executor.layers.activation import get_act_fn

    path, name = activation
    parent, _, attr = path.rpartition(".")
    changed = 0
    for i in range(n_layers):
        layer = layers[i]
        if type(layer).__name__ == "PPMissingLayer":
            continue
        owner = layer.get_submodule(".".join(p for p in (mlp, parent) if p))
        if not hasattr(owner, attr):
            raise AttributeError(f"layer {i} has no activation module at {path!r} of its MLP")
        setattr(owner, attr, get_act_fn(name))
        changed += 1
    return changed
