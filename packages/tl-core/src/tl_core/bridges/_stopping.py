"""Which hooks a forward that stops before a block still reaches."""

from __future__ import annotations

from collections.abc import Mapping

from tl_core.driver_api._layers import runs_between
from tl_core.hooks._dictionary_sites import DictionarySite

__all__ = ["reached"]


def reached(name: str, stop: int, dictionaries: Mapping[str, DictionarySite] | None = None) -> bool:
    """Whether a forward stopped before block ``stop`` reaches canonical hook ``name``
    (the sites of ``dictionaries`` where their dictionary runs)."""
    return runs_between(name, None, stop, dictionaries)
