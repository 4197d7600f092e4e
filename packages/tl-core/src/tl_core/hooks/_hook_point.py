"""``HookPoint``: an identity module at a named site that runs user hooks."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import nn

from tl_core._errors import UserError

__all__ = ["HookFn", "HookHandle", "HookPoint", "RuleHook", "only_rerouted"]


class HookFn(Protocol):
    """A hook: ``fn(tensor, hook=hook_point)`` returns a replacement tensor or ``None``."""

    def __call__(self, tensor: torch.Tensor, /, *, hook: HookPoint) -> torch.Tensor | None: ...


class RuleHook:
    """A forward hook installed by a backward rule (``tl_core.analysis.use_relevance_rules``).

    A ``HookPoint`` keeps rule hooks at the ends of its forward list, whatever users attach
    later: ``stage = "first"`` hooks run before every user hook (so users read the value the
    rule hands on, the one the gradient flows through) and ``stage = "last"`` hooks after
    them (so a rule reads the value the model really uses, user edits included). Rule hooks
    survive ``remove_hooks``; only their handle removes them. Subclasses implement
    ``__call__(tensor, hook=...)`` like any hook.
    """

    stage: ClassVar[Literal["first", "last"]] = "last"

    def __call__(self, tensor: torch.Tensor, /, *, hook: HookPoint) -> torch.Tensor | None:
        raise NotImplementedError


def _stage(fn: object) -> str | None:
    return fn.stage if isinstance(fn, RuleHook) else None


def _hook_label(fn: object) -> str:
    """A hook's name for messages: its function name, else its class name."""
    name = getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


_EXPECTED = {
    "fwd": "def fn(activation, hook): ...  (return a tensor of the same shape to replace "
    "the value, or None to keep it)",
    "bwd": "def fn(grad, hook): ...  (the return value is ignored)",
}

# Classes whose __call__ is plain Python have one signature per class: checking it once
# keeps the capture and edit hooks that drivers attach on every forward cheap.
_CALL_STYLE_BY_TYPE: dict[type, Literal["keyword", "positional"]] = {}


def _call_style(
    fn: Callable[..., Any], site: str, dir: Literal["fwd", "bwd"]
) -> Literal["keyword", "positional"]:
    """How a hook can be called: ``fn(x, hook=point)`` or ``fn(x, point)``.

    TransformerLens calls hooks as ``fn(x, hook=hook_point)``; a hook that cannot take that
    call would fail deep inside the forward, so it is refused when it is attached.

    Raises:
        UserError: ``fn`` takes neither call (it has no ``hook`` parameter, ``**kwargs`` or
            second positional parameter, or more required parameters than those).
    """
    if isinstance(fn, RuleHook):
        return "keyword"
    kind = type(fn)
    cacheable = not isinstance(fn, (types.FunctionType, types.MethodType)) and isinstance(
        kind.__call__, types.FunctionType
    )
    if cacheable and kind in _CALL_STYLE_BY_TYPE:
        return _CALL_STYLE_BY_TYPE[kind]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return "keyword"  # a builtin without a signature: nothing to check
    style: Literal["keyword", "positional"]
    if _binds(signature, None, hook=None):
        style = "keyword"
    elif _binds(signature, None, None):
        style = "positional"
    else:
        value = "activation" if dir == "fwd" else "grad"
        raise UserError(
            f"hook {_hook_label(fn)!r} on {site!r} has the signature {signature}, but tl "
            f"calls every {'forward' if dir == 'fwd' else 'backward'} hook as "
            f"fn({value}, hook=hook_point), as TransformerLens does, and this function "
            f"cannot take that call. Define it as `{_EXPECTED[dir]}`; a lambda needs both "
            f"parameters too: `lambda {value}, hook: ...`"
        )
    if cacheable:
        _CALL_STYLE_BY_TYPE[kind] = style
    return style


def _binds(signature: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


class _PositionalHook:
    """Calls a hook whose second parameter is positional, not named ``hook``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = _hook_label(fn)

    def __call__(self, tensor: torch.Tensor, /, *, hook: HookPoint) -> Any:
        return self.fn(tensor, hook)


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

    Attributes:
        name: The canonical hook name.
        edit_refusal: While not ``None``, a user forward hook that returns a different
            value raises ``UserError`` with this reason (a backward rule owns the value here;
            reading hooks and value-preserving gradient probes stay allowed). Checked only
            when a hook returns a new tensor, so unhooked and reading runs pay nothing.
        replacement: While not ``None``, a function the value passes through after every
            forward hook (a spliced dictionary: hooks at the site see the model's own value,
            the rest of the model sees the replacement).
    """

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self.name = name
        self.edit_refusal: str | None = None
        self.replacement: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._fwd: list[tuple[Callable[..., Any], bool]] = []
        self._bwd: list[tuple[Callable[..., Any], bool]] = []

    @property
    def has_hooks(self) -> bool:
        """Whether any forward or backward hook is attached."""
        return bool(self._fwd or self._bwd) or self.replacement is not None

    @property
    def has_forward_hooks(self) -> bool:
        """Whether a forward hook is attached (one that may replace the value)."""
        return bool(self._fwd) or self.replacement is not None

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
            fn: The hook, ``fn(tensor, hook)``: it is called with ``hook=self`` when it
                has a ``hook`` parameter or ``**kwargs``, else with the hook point as its
                second positional argument. A forward hook may return a tensor of the
                same shape to replace the value; a backward hook's return value is
                ignored (gradients are read-only). A ``RuleHook`` goes to its stage's end
                of the forward list.
            dir: ``"fwd"`` for the forward value, ``"bwd"`` for its gradient.
            is_permanent: Permanent hooks survive ``remove_hooks(including_permanent=False)``.
            prepend: Run before the hooks already attached (after any ``"first"`` rule hook).

        Returns:
            A handle whose ``remove()`` detaches exactly this hook.

        Raises:
            UserError: ``fn`` is not callable, or takes neither call (it needs a
                parameter named ``hook``, ``**kwargs`` or a second positional parameter).
        """
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        if not callable(fn):
            raise UserError(
                f"the hook for {self.name!r} is {type(fn).__name__} {fn!r}, not a function; "
                f"pass `{_EXPECTED[dir]}`"
            )
        if _call_style(fn, self.name, dir) == "positional":
            fn = _PositionalHook(fn)
        hooks = self._fwd if dir == "fwd" else self._bwd
        entry = (fn, is_permanent)
        stage = _stage(fn)
        if stage == "first":
            hooks.insert(0, entry)
        elif stage == "last":
            hooks.append(entry)
        elif prepend:
            index = 0
            while index < len(hooks) and _stage(hooks[index][0]) == "first":
                index += 1
            hooks.insert(index, entry)
        else:
            index = len(hooks)
            while index > 0 and _stage(hooks[index - 1][0]) == "last":
                index -= 1
            hooks.insert(index, entry)
        return HookHandle(self, dir, fn)

    def remove_hooks(
        self, dir: Literal["fwd", "bwd", "both"] = "both", *, including_permanent: bool = False
    ) -> None:
        """Detach hooks in one or both directions (rule hooks stay: their handle owns them)."""
        for direction in ("fwd", "bwd"):
            if dir not in (direction, "both"):
                continue
            hooks = self._fwd if direction == "fwd" else self._bwd
            hooks[:] = [
                (fn, perm)
                for fn, perm in hooks
                if (perm and not including_permanent) or isinstance(fn, RuleHook)
            ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the forward hooks in order, then arm the backward hooks on the result.

        Raises:
            UserError: A hook returned something other than ``None`` or a tensor of the
                value's shape (raised at that hook, naming it and the site).
        """
        for fn, _ in self._fwd:
            out = fn(x, hook=self)
            if out is not None and out is not x:
                self._check_returned(fn, x, out)
                if self.edit_refusal is not None:
                    self._check_edit(fn, x, out)
                x = out
        if self.replacement is not None:
            x = self.replacement(x)
        if self._bwd and x.requires_grad:
            for fn, _ in self._bwd:
                x.register_hook(_BackwardCall(fn, self))  # type: ignore[no-untyped-call]
        return x

    def _check_returned(self, fn: Callable[..., Any], x: torch.Tensor, out: object) -> None:
        """Refuse a forward hook's return value that cannot replace ``x``.

        A wrong shape would otherwise fail (or silently broadcast) somewhere downstream,
        far from the hook that caused it.
        """
        if not isinstance(out, torch.Tensor):
            raise UserError(
                f"hook {_hook_label(fn)!r} on {self.name!r} returned {type(out).__name__} "
                f"{_short(out)}; a forward hook returns a tensor of shape {tuple(x.shape)} "
                f"(the value it was given, edited) or None to keep the value"
            )
        if out.shape != x.shape:
            raise UserError(
                f"hook {_hook_label(fn)!r} on {self.name!r} returned a tensor of shape "
                f"{tuple(out.shape)}, but the value there has shape {tuple(x.shape)}; a "
                f"forward hook must return a tensor of the same shape (edit the value it was "
                f"given and return it), or None to keep the value"
            )

    def _check_edit(self, fn: Callable[..., Any], x: torch.Tensor, out: torch.Tensor) -> None:
        """Refuse a user hook's new value while ``edit_refusal`` is set.

        A tensor with the same value (a gradient probe such as ``x + zeros``) is no edit.
        """
        if isinstance(fn, RuleHook) or (
            out.shape == x.shape and out.dtype == x.dtype and torch.equal(out, x)
        ):
            return
        raise UserError(
            f"hook {_hook_label(fn)!r} on {self.name!r} returned "
            f"a new value, but {self.name!r} cannot be edited now: {self.edit_refusal}"
        )

    def extra_repr(self) -> str:
        """The hook's name, shown inside ``repr(model)``."""
        return repr(self.name)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _BackwardCall:
    """Adapts a ``fn(grad, hook=...)`` hook to ``Tensor.register_hook``'s one-argument call."""

    def __init__(self, fn: Callable[..., Any], hook_point: HookPoint) -> None:
        self._fn = fn
        self._hook_point = hook_point

    def __call__(self, grad: torch.Tensor) -> None:
        self._fn(grad, hook=self._hook_point)


def only_rerouted(*fired: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether some hook returned a new tensor and every hook kept the value it was given.

    Drivers that compute a site step by step when hooks are attached (attention's scores
    and pattern) use it to keep the fast kernel's bits when the hooks only reroute the
    gradient (relevance rules, probes, backward hooks): the forward then stays bit-identical.

    Args:
        *fired: ``(value handed to the hook, value the hook returned)`` pairs; the returned
            value may have another shape with the same elements (a transposed view).

    Returns:
        ``True`` when at least one hook returned a new tensor and all returned values equal
        what they were given.
    """
    new = [(before, after) for before, after in fired if after is not before]
    return bool(new) and all(
        torch.equal(before, after.reshape(before.shape)) for before, after in new
    )
