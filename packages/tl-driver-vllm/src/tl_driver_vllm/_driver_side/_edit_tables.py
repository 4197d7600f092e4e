"""Driver side: a run's specs compiled to the stacked edit tables its workers apply.

A prompt's table on one hook holds rows of ``x * scale + bias``: one row per prompt
position when any spec lists positions (else one row for every prompt position), then one
row for generated tokens, where only specs without ``pos`` apply. ``EditTables`` stacks
every prompt's rows per hook for the run's ``RunMessage``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tl_core import InterventionSpec
from tl_core.driver_api import compile_specs
from tl_driver_vllm._run_message import EditRows, StackedEdits

__all__ = ["EditTables", "edit_table"]


def edit_table(
    specs: Sequence[InterventionSpec],
    *,
    length: int,
    feature_shape: tuple[int, ...],
) -> dict[str, Any]:
    """One prompt's specs on one hook as table rows, features flattened.

    Args:
        specs: The prompt's specs on the hook, positions already absolute.
        length: The prompt's length.
        feature_shape: The hook's per-position shape (``(d_model,)``, ``(heads, d_head)``).

    Returns:
        ``{"scale", "bias"}`` (float32 ``[rows, prod(feature_shape)]``, head-major for head
        sites, so a tensor-parallel rank takes its heads as a column range) and
        ``"positional"``.
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
        return t.expand(rows, *feature_shape).reshape(rows, width)

    scale, bias = flat(edit.scale), flat(edit.bias)
    return {"scale": scale, "bias": bias, "positional": positional}


class EditTables:
    """One run's edit tables, each compiled once and stacked per hook: prompts with the
    same specs on a hook share their rows (one part per prompt length when the specs list
    positions)."""

    def __init__(self, feature_shape: Callable[[str], tuple[int, ...]]) -> None:
        """``feature_shape(hook)`` gives a hook's per-position shape."""
        self._feature_shape = feature_shape
        self._rows: dict[tuple[Any, ...], EditRows] = {}
        self._parts: dict[str, list[dict[str, Any]]] = {}
        self._height: dict[str, int] = {}

    def rows(self, hook: str, specs: Sequence[InterventionSpec], length: int) -> EditRows:
        """Where the rows of ``specs`` on ``hook`` for a prompt of ``length`` tokens start."""
        specs = tuple(specs)
        positional = any(spec.pos is not None for spec in specs)
        key = (hook, specs, length if positional else None)
        if key not in self._rows:
            table = edit_table(specs, length=length, feature_shape=self._feature_shape(hook))
            self._rows[key] = EditRows(self._height.get(hook, 0), positional)
            self._parts.setdefault(hook, []).append(table)
            self._height[hook] = self._height.get(hook, 0) + table["scale"].shape[0]
        return self._rows[key]

    def stacked(self) -> dict[str, StackedEdits]:
        """Hook -> every part's rows, in the order ``rows`` handed out their offsets (one
        copy: the parts may be views of one row)."""
        return {
            hook: StackedEdits(
                torch.cat([p["scale"] for p in parts]), torch.cat([p["bias"] for p in parts])
            )
            for hook, parts in self._parts.items()
        }
