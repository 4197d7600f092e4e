"""Driver side: one prompt's specs on one hook compiled to an edit table for the workers.

A table holds rows of ``x * scale + bias``: one row per prompt position when any spec lists
positions (else one row for every prompt position), then one row for generated tokens,
where only specs without ``pos`` apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tl_core import InterventionSpec
from tl_core.driver_api import compile_specs
from tl_driver_vllm._wire import pack

__all__ = ["EditTables", "edit_table"]


def edit_table(
    specs: Sequence[InterventionSpec],
    *,
    length: int,
    feature_shape: tuple[int, ...],
    raw: bool = False,
) -> dict[str, Any]:
    """One prompt's specs on one hook as table rows, features flattened.

    Args:
        specs: The prompt's specs on the hook, positions already absolute.
        length: The prompt's length.
        feature_shape: The hook's per-position shape (``(d_model,)``, ``(heads, d_head)``).
        raw: The workers run in this process: hand the tensors over as they are (``pack``).

    Returns:
        ``{"scale", "bias"}`` (float32 ``[rows, prod(feature_shape)]``, packed unless ``raw``;
        head-major for head sites, so a tensor-parallel rank takes its heads as a column
        range) and ``"positional"``.
    """
    width = math.prod(feature_shape)
    positional = any(spec.pos is not None for spec in specs)
    # One compilation covers both parts: positions are absolute and inside the prompt, so
    # the row after it (the first generated token) is edited by the specs without ``pos``
    # alone, composed in the same order.
    edit = compile_specs(
        specs, feature_shape=feature_shape, seq_len=length + 1, dtype=torch.float32, device="cpu"
    )
    rows = length + 1 if positional else 2

    def flat(t: torch.Tensor) -> torch.Tensor:
        if not positional:  # shape () or feature_shape: one row serves every position
            t = t.expand(*feature_shape)[None]
        return t.expand(rows, *feature_shape).reshape(rows, width).contiguous()

    scale, bias = flat(edit.scale), flat(edit.bias)
    return {"scale": pack(scale, raw=raw), "bias": pack(bias, raw=raw), "positional": positional}


class EditTables:
    """One run's edit tables, each compiled once: prompts with the same specs on a hook
    share one table (one per prompt length when the specs list positions)."""

    def __init__(self, feature_shape: Callable[[str], tuple[int, ...]], *, raw: bool) -> None:
        """``feature_shape(hook)`` gives a hook's per-position shape; ``raw`` as ``edit_table``."""
        self._feature_shape = feature_shape
        self._raw = raw
        self._tables: dict[tuple[Any, ...], dict[str, Any]] = {}

    def get(self, hook: str, specs: Sequence[InterventionSpec], length: int) -> dict[str, Any]:
        """The table of ``specs`` on ``hook`` for a prompt of ``length`` tokens."""
        specs = tuple(specs)
        positional = any(spec.pos is not None for spec in specs)
        key = (hook, specs, length if positional else None)
        if key not in self._tables:
            self._tables[key] = edit_table(
                specs, length=length, feature_shape=self._feature_shape(hook), raw=self._raw
            )
        return self._tables[key]
