"""Checks of ``forward``'s inputs that run before any engine work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tl_core import SpecError, UserError

__all__ = ["check_tokens", "refuse_positions", "token_rows"]


def token_rows(input_ids: Any) -> list[list[int]]:
    """Prompts as lists of ints, from a ``[pos]``/``[batch, pos]`` tensor or (nested) lists.

    Raises:
        UserError: Empty prompts, non-integer ids, wrong tensor rank.
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise UserError(f"input_ids must hold integer token ids, found dtype {input_ids.dtype}")
        if input_ids.ndim not in (1, 2):
            raise UserError(
                f"input_ids must be [pos] or [batch, pos], found shape {tuple(input_ids.shape)}"
            )
        input_ids = input_ids.tolist()
    if isinstance(input_ids, str | bytes) or not isinstance(input_ids, Sequence) or not input_ids:
        raise UserError(
            "input_ids must be a non-empty list of token-id lists (the bridge tokenizes text)"
        )
    items = list(input_ids)
    nested = [items] if all(isinstance(t, int) for t in items) else items
    rows = []
    for b, row in enumerate(nested):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if isinstance(row, str | bytes) or not isinstance(row, Sequence) or not row:
            raise UserError(f"prompt {b} of input_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise UserError(f"prompt {b} of input_ids holds non-integer values")
        rows.append([int(t) for t in row])
    return rows


def refuse_positions(per_prompt: Sequence[Mapping[str, Any]]) -> None:
    """Raise if a spec has ``pos`` (engines booted with ``enable_position_interventions=False``).

    Raises:
        SpecError: Naming the hook and the prompt.
    """
    for b, mapping in enumerate(per_prompt):
        for hook, specs in mapping.items():
            if any(spec.pos is not None for spec in specs):
                raise SpecError(
                    f"intervention on {hook!r} for prompt {b}: key 'pos' is not allowed, this "
                    "engine was booted with enable_position_interventions=False; drop 'pos' "
                    "or boot with enable_position_interventions=True"
                )


def check_tokens(rows: list[list[int]], max_new_tokens: int, *, vocab: int, limit: int) -> None:
    """Refuse ids outside the vocabulary and prompts too long for the engine.

    Raises:
        UserError: Naming the prompt and the offending id or length.
    """
    for b, row in enumerate(rows):
        bad = next((t for t in row if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(
                f"prompt {b} holds token id {bad}, outside the vocabulary 0..{vocab - 1}"
            )
        if len(row) + max(1, max_new_tokens) > limit:
            raise UserError(
                f"prompt {b} has {len(row)} tokens; with {max(1, max_new_tokens)} new "
                f"token(s) that exceeds the engine's max_model_len={limit}; shorten it or "
                "boot with a larger max_model_len"
            )
