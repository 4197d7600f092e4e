"""Metrics on logits for attribution: logit differences per prompt."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tl_core._errors import UserError

__all__ = ["logit_diff", "logit_diff_metric"]

TokenChoice = int | Sequence[int] | torch.Tensor
Positions = int | Sequence[int] | torch.Tensor


def _per_row(
    value: TokenChoice | Positions, batch: int, what: str, device: torch.device
) -> torch.Tensor:
    tensor = torch.as_tensor(value, dtype=torch.long, device=device)
    if tensor.ndim == 0:
        return tensor.expand(batch)
    if tensor.shape != (batch,):
        raise UserError(
            f"logit_diff: {what} has shape {tuple(tensor.shape)}; give one int for every prompt "
            f"or a sequence of {batch} (one per prompt)."
        )
    return tensor


def logit_diff(
    logits: torch.Tensor,
    correct: TokenChoice,
    incorrect: TokenChoice,
    positions: Positions = -1,
) -> torch.Tensor:
    """``logits[correct] - logits[incorrect]`` at one position of each prompt.

    Args:
        logits: ``[batch, pos, d_vocab]``.
        correct: The answer token id, one for all prompts or one per prompt.
        incorrect: The competing token id, one for all prompts or one per prompt.
        positions: Where to read, one for all prompts or one per prompt (negative counts
            from the end of the padded row: with ragged prompts give each one's last index).

    Returns:
        ``[batch]`` logit differences.

    Raises:
        UserError: Logits that are not ``[batch, pos, d_vocab]``, or per-prompt arguments
            whose length is not the batch size.
    """
    if logits.ndim != 3:
        raise UserError(
            f"logit_diff needs logits [batch, pos, d_vocab], got shape {tuple(logits.shape)}."
        )
    batch = logits.shape[0]
    rows = torch.arange(batch, device=logits.device)
    where = _per_row(positions, batch, "positions", logits.device)
    at = logits[rows, where]
    good = _per_row(correct, batch, "correct", logits.device)
    bad = _per_row(incorrect, batch, "incorrect", logits.device)
    return at[rows, good] - at[rows, bad]


def logit_diff_metric(
    correct: TokenChoice, incorrect: TokenChoice, positions: Positions = -1
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric for ``attribution_patch``: ``logits -> logit_diff(logits, ...)`` per prompt."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logit_diff(logits, correct, incorrect, positions)

    return metric
