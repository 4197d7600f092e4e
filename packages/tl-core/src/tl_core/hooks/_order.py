"""Sort canonical hook names in the order a forward pass reaches them."""

from __future__ import annotations

from collections.abc import Iterable

from tl_core.hooks._dictionary_sites import DICTIONARY_SITES, split_dictionary_name
from tl_core.hooks._vocabulary import (
    BEFORE_BLOCKS,
    CANONICAL_TEMPLATES,
    STACK_PREFIXES,
    split_canonical,
)

__all__ = ["forward_order"]

_RANK = {t.template: i for i, t in enumerate(CANONICAL_TEMPLATES)}


def _key(name: str) -> tuple[int, int, int, int]:
    # A dictionary's sites come right after the site they sit under, in their own order.
    under = split_dictionary_name(name)
    if under is not None:
        return (*_key(under[0])[:3], 1 + DICTIONARY_SITES.index(under[1]))
    split = split_canonical(name)
    if split is None:
        raise ValueError(f"forward_order takes canonical hook names, got {name!r}")
    template, layer = split
    rank = _RANK[template.template]
    if layer is not None:
        # An encoder's blocks all run before a decoder's first.
        return (1 + STACK_PREFIXES.index(name.split(".", 1)[0]), layer, rank, 0)
    # Global hooks: inputs and embeddings before the blocks, final norm and unembed after.
    return (0 if name in BEFORE_BLOCKS else 1 + len(STACK_PREFIXES), 0, rank, 0)


def forward_order(names: Iterable[str]) -> list[str]:
    """``names`` (canonical) sorted by when the forward pass computes them."""
    return sorted(names, key=_key)
