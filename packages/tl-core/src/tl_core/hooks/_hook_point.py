"""``HookPoint``: an identity module at a named site that runs user hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch
from torch import nn

__all__ = ["HookFn", "HookHandle", "HookPoint"]


class HookFn(Protocol):
    """A hook: ``fn(tensor, hook=hook_point)`` returns a replacement tensor or ``None``."""

    def __call__(self, tensor: torch.Tensor, /, *, hook: HookPoint) -> torch.Tensor | None: ...


class HookHandle:
    """Removes one hook from its ``HookPoint`` when ``remove()`` is called."""

    def __init__(self, hook_point: HookPoint, direction: Literal["fwd", "bwd"], fn: Any) -> None:
        self._hook_point = hook_point
        self._direction = direction
        self._fn = fn

    def remove(self) -> None:
        """Detach the hook; removing twice is harmless."""
        hooks = self._hook_point._fwd if self._direction == "fwd" else self._hook_point._bwd
        for index, (fn, _) in enumerate(hooks):
            if fn is self._fn:
                del hooks[index]
                return


class HookPoint(nn.Module):
    """An identity module placed at one named site of a forward pass.

    Forward hooks see the value and may return a replacement; backward hooks see the
    gradient of the loss with respect to the value. With no hooks attached the forward is
    a single attribute check, so an unhooked model runs at full speed.

    Hooks are kept in plain lists rather than torch's hook dictionaries: that keeps the
    hot path cheap and lets a hook receive the ``HookPoint`` (and so its name).
    """

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self.name = name
        self._fwd: list[tuple[Callable[..., Any], bool]] = []
        self._bwd: list[tuple[Callable[..., Any], bool]] = []

    @property
    def has_hooks(self) -> bool:
        """Whether any forward or backward hook is attached."""
        return bool(self._fwd or self._bwd)

    @property
    def has_forward_hooks(self) -> bool:
        """Whether a forward hook is attached (one that may replace the value)."""
        return bool(self._fwd)

    @property
    def has_backward_hooks(self) -> bool:
        """Whether a backward hook is attached.

        Drivers that fire a hook on a view they build (a reshape, a transpose) must then
        hand that view on to the model, so the gradient reaches the hook.
        """
        return bool(self._bwd)

    def add_hook(
        self,
        fn: Callable[..., Any],
        dir: Literal["fwd", "bwd"] = "fwd",
        *,
        is_permanent: bool = False,
        prepend: bool = False,
    ) -> HookHandle:
        """Attach ``fn(tensor, hook=self)``.

        Args:
            fn: The hook. A forward hook may return a tensor to replace the value; a
                backward hook's return value is ignored (gradients are read-only).
            dir: ``"fwd"`` for the forward value, ``"bwd"`` for its gradient.
            is_permanent: Permanent hooks survive ``remove_hooks(including_permanent=False)``.
            prepend: Run before the hooks already attached.

        Returns:
            A handle whose ``remove()`` detaches exactly this hook.
        """
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        hooks = self._fwd if dir == "fwd" else self._bwd
        entry = (fn, is_permanent)
        if prepend:
            hooks.insert(0, entry)
        else:
            hooks.append(entry)
        return HookHandle(self, dir, fn)

    def remove_hooks(
        self, dir: Literal["fwd", "bwd", "both"] = "both", *, including_permanent: bool = False
    ) -> None:
        """Detach hooks in one or both directions."""
        for direction in ("fwd", "bwd"):
            if dir not in (direction, "both"):
                continue
            hooks = self._fwd if direction == "fwd" else self._bwd
            hooks[:] = [(fn, perm) for fn, perm in hooks if perm and not including_permanent]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the forward hooks in order, then arm the backward hooks on the result."""
        for fn, _ in self._fwd:
            out = fn(x, hook=self)
            if out is not None:
                if not isinstance(out, torch.Tensor):
                    raise TypeError(
                        f"hook {getattr(fn, '__name__', fn)!r} on {self.name!r} returned "
                        f"{type(out).__name__}; a forward hook returns a tensor or None"
                    )
                x = out
        if self._bwd and x.requires_grad:
            for fn, _ in self._bwd:
                x.register_hook(_BackwardCall(fn, self))  # type: ignore[no-untyped-call]
        return x

    def extra_repr(self) -> str:
        return repr(self.name)


class _BackwardCall:
    """Adapts a ``fn(grad, hook=...)`` hook to ``Tensor.register_hook``'s one-argument call."""

    def __init__(self, fn: Callable[..., Any], hook_point: HookPoint) -> None:
        self._fn = fn
        self._hook_point = hook_point

    def __call__(self, grad: torch.Tensor) -> None:
        self._fn(grad, hook=self._hook_point)
