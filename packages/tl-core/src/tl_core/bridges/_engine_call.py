"""``EngineCall``: what one engine call of a bridge method asks of its driver."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tl_core.hooks._vocabulary import BEFORE_BLOCKS, split_canonical

__all__ = ["EngineCall", "reached"]


@dataclass(frozen=True)
class EngineCall:
    """What one engine call of a bridge method asks for (see ``Bridge._execute``).

    Attributes:
        capture: Canonical hooks to return.
        intervene: The ``intervene=`` argument as the user gave it.
        max_new_tokens: Tokens to generate (0: prefill only).
        need_logits: Whether the caller uses the sequence logits.
        capture_device: Where captures go (``None``: where computed).
        start_at_layer: Start at this block from ``residual`` (local drivers).
        stop_at_layer: Stop before this block; ``logits`` then holds the residual stream.
        residual: The residual stream entering ``start_at_layer``.
        sampling: Sampling options and ``stop_at_eos`` for generation.
    """

    capture: Sequence[str] = ()
    intervene: Any = None
    max_new_tokens: int = 0
    need_logits: bool = True
    capture_device: torch.device | str | None = None
    start_at_layer: int | None = None
    stop_at_layer: int | None = None
    residual: torch.Tensor | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


def reached(name: str, stop: int) -> bool:
    """Whether a forward stopped before block ``stop`` reaches canonical hook ``name``."""
    split = split_canonical(name)
    layer = None if split is None else split[1]
    if layer is not None:
        return layer < stop
    return name in BEFORE_BLOCKS
