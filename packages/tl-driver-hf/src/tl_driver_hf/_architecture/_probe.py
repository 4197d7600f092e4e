"""One probe forward of an undescribed model: when each module runs, what it reads and returns.

``infer_architecture`` (``_infer``) reads the module tree from these records; certification
runs its reference forwards on the same ``probe_ids``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleCall", "first_tensor", "path_of", "probe_ids", "recording", "same_tensor"]


@dataclass
class ModuleCall:
    """One module's first call in the probe."""

    start: int
    end: int = -1
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    kwargs: tuple[str, ...] = ()
    #: The output is ``(logits, top-k weights, top-k indices)``: a router.
    routes: bool = False


def probe_ids(vocab: int, n: int = 6) -> torch.Tensor:
    """Fixed, varied token ids for probes and certification: ``[1, n]`` below ``vocab``."""
    ids = [(7 + 13 * i) % max(1, vocab - 1) + 1 for i in range(n)]
    return torch.tensor([ids], dtype=torch.long)


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a module's output (a tuple, a list, or a model output)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
        return None
    hidden = getattr(value, "last_hidden_state", None)
    return hidden if isinstance(hidden, torch.Tensor) else None


@contextmanager
def recording(model: nn.Module) -> Iterator[dict[int, ModuleCall]]:
    """Record each module's first call (keyed by ``id(module)``) while the block runs."""
    calls: dict[int, ModuleCall] = {}
    clock = [0]
    handles = []

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if id(module) in calls:
            return
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        keys = tuple(kwargs)
        table = kwargs.get("position_embeddings")
        if not (isinstance(table, (tuple, list)) and len(table) == 2):
            # Only a (cos, sin) pair is a rotary table tl serves (Llama 4 passes complex ones).
            keys = tuple(k for k in keys if k != "position_embeddings")
        calls[id(module)] = ModuleCall(
            clock[0], input=x if isinstance(x, torch.Tensor) else None, kwargs=keys
        )
        clock[0] += 1

    def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        call = calls.get(id(module))
        if call is not None and call.end < 0:
            call.end = clock[0]
            call.output = first_tensor(output)
            call.routes = (
                isinstance(output, tuple)
                and len(output) == 3
                and all(isinstance(t, torch.Tensor) for t in output)
                and not output[2].dtype.is_floating_point
            )
            clock[0] += 1

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def path_of(model: nn.Module, target: nn.Module | None) -> str | None:
    """The dotted path of ``target`` inside ``model``, or ``None``."""
    if target is None:
        return None
    for name, module in model.named_modules():
        if module is target:
            return str(name)
    return None


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether both are tensors of one shape and equal values."""
    return a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b))
