"""Which hooks a forward that stops before a block still reaches."""

from __future__ import annotations

from tl_core.hooks._vocabulary import BEFORE_BLOCKS, split_canonical

__all__ = ["reached"]


def reached(name: str, stop: int) -> bool:
    """Whether a forward stopped before block ``stop`` reaches canonical hook ``name``."""
    split = split_canonical(name)
    layer = None if split is None else split[1]
    if layer is not None:
        return layer < stop
    return name in BEFORE_BLOCKS
