"""Plain torch hooks the tests use as references, independent of tl's wiring."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def layer_inputs(layers: Iterable[nn.Module], seen: list[torch.Tensor]) -> Iterator[None]:
    """Append to ``seen`` the hidden-states input of every layer call (forward pre-hooks)."""

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
