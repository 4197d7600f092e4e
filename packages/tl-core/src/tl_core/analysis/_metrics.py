"""Metrics on logits for attribution: logit differences per prompt, read at real positions.

Bridges run a ragged batch right-padded, so column ``-1`` of a shorter prompt is padding.
``logit_diff`` therefore reads each prompt at its own positions when it knows the prompts'
lengths, and a metric that takes a ``lengths`` keyword (``logit_diff_metric``'s does) is
handed them by ``attribution_patch`` and ``backward_lens`` (see ``call_metric``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from tl_core._errors import UserError

__all__ = [
    "call_metric",
    "describe_metric",
    "logit_diff",
    "logit_diff_metric",
    "non_finite",
    "takes_lengths",
]

TokenChoice = int | Sequence[int] | torch.Tensor
Positions = int | Sequence[int] | torch.Tensor
Metric = Callable[..., torch.Tensor]


def _per_row(
    value: TokenChoice | Positions, batch: int, what: str, device: torch.device
) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError):
        tensor = None
    if (
        tensor is None
        or tensor.dtype.is_floating_point
        or tensor.dtype
        in (
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    ):
        raise UserError(
            f"logit_diff: {what} must be an int or ints (one per prompt), got {value!r}."
        )
    tensor = tensor.to(torch.long)
    if tensor.ndim == 0:
        return tensor.expand(batch)
    if tensor.shape != (batch,):
        raise UserError(
            f"logit_diff: {what} has shape {tuple(tensor.shape)}; give one int for every prompt "
            f"or a sequence of {batch} (one per prompt)."
        )
    return tensor


def _real_lengths(lengths: Sequence[int] | None, batch: int, width: int) -> list[int]:
    if lengths is None:
        return [width] * batch
    values = list(lengths)
    if len(values) != batch:
        raise UserError(
            f"logit_diff: lengths has {len(values)} entries but the logits hold {batch} "
            f"prompt(s); give each prompt's real length."
        )
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= width:
            raise UserError(
                f"logit_diff: lengths[{i}] is {value!r}; each must be an int from 1 to the "
                f"logits' {width} positions."
            )
    return values


def _columns(
    positions: Positions | None,
    lengths: list[int],
    width: int,
    padding_side: str,
    device: torch.device,
) -> torch.Tensor:
    """The column of each prompt to read: its own position, shifted past left padding."""
    batch = len(lengths)
    if positions is None:
        wanted = [length - 1 for length in lengths]
    else:
        wanted = _per_row(positions, batch, "positions", torch.device("cpu")).tolist()
    columns = []
    for i, (position, length) in enumerate(zip(wanted, lengths, strict=True)):
        own = position + length if position < 0 else position
        if not 0 <= own < length:
            padded = "" if length == width else f" real (of {width} padded)"
            raise UserError(
                f"logit_diff: position {position} is out of range for prompt {i}, which has "
                f"{length}{padded} tokens (valid: {-length}..{length - 1}; negatives count "
                f"from the prompt's own end); give positions inside every prompt."
            )
        columns.append(own + (width - length if padding_side == "left" else 0))
    return torch.tensor(columns, dtype=torch.long, device=device)


def logit_diff(
    logits: torch.Tensor,
    correct: TokenChoice,
    incorrect: TokenChoice,
    positions: Positions | None = None,
    *,
    lengths: Sequence[int] | None = None,
    padding_side: Literal["right", "left"] = "right",
) -> torch.Tensor:
    """``logits[correct] - logits[incorrect]`` at one position of each prompt.

    Args:
        logits: ``[batch, pos, d_vocab]``.
        correct: The answer token id, one for all prompts or one per prompt.
        incorrect: The competing token id, one for all prompts or one per prompt.
        positions: Where to read, one for all prompts or one per prompt, counted within
            each prompt's own tokens (negatives from its own end); ``None`` reads each
            prompt's last token.
        lengths: Each prompt's real length when the batch is padded (``cache.lengths``;
            ``attribution_patch`` passes it to the metric). ``None``: every row is all real.
        padding_side: Where the padding of a ragged batch is (bridges pad on the right).

    Returns:
        ``[batch]`` logit differences.

    Raises:
        UserError: Logits that are not ``[batch, pos, d_vocab]``, per-prompt arguments whose
            length is not the batch size, a position a prompt does not have, token ids
            outside the vocabulary, or lengths that do not fit the logits.
    """
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3:
        found = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise UserError(f"logit_diff needs logits [batch, pos, d_vocab], got {found}.")
    if padding_side not in ("right", "left"):
        raise UserError(
            f"logit_diff: padding_side must be 'right' or 'left', got {padding_side!r}."
        )
    batch, width, d_vocab = logits.shape
    real = _real_lengths(lengths, batch, width)
    rows = torch.arange(batch, device=logits.device)
    at = logits[rows, _columns(positions, real, width, padding_side, logits.device)]
    good = _per_row(correct, batch, "correct", logits.device)
    bad = _per_row(incorrect, batch, "incorrect", logits.device)
    for what, ids in (("correct", good), ("incorrect", bad)):
        if bool(((ids < 0) | (ids >= d_vocab)).any()):
            raise UserError(
                f"logit_diff: {what} holds token ids {ids.tolist()}, outside the "
                f"vocabulary 0..{d_vocab - 1}."
            )
    return at[rows, good] - at[rows, bad]


def logit_diff_metric(
    correct: TokenChoice, incorrect: TokenChoice, positions: Positions | None = None
) -> Callable[..., torch.Tensor]:
    """A metric for ``attribution_patch``: ``(logits, lengths=None) -> logit_diff(...)`` per
    prompt, read at each prompt's own last token (or ``positions`` within each prompt)."""

    def metric(logits: torch.Tensor, lengths: Sequence[int] | None = None) -> torch.Tensor:
        return logit_diff(logits, correct, incorrect, positions, lengths=lengths)

    metric.__name__ = metric.__qualname__ = "logit_diff_metric"
    return metric


def takes_lengths(metric: Callable[..., object]) -> bool:
    """Whether ``metric`` has a ``lengths`` parameter that can be passed by keyword."""
    try:
        parameter = inspect.signature(metric).parameters.get("lengths")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def call_metric(metric: Metric, logits: torch.Tensor, lengths: Sequence[int]) -> object:
    """``metric(logits)``, with ``lengths=`` (each prompt's real length) if it takes it."""
    if takes_lengths(metric):
        return metric(logits, lengths=tuple(lengths))
    return metric(logits)


def describe_metric(metric: object) -> str:
    """A metric's name for messages: ``'logit_diff_metric'``, ``'my_metric'``, ``'<lambda>'``."""
    name = getattr(metric, "__name__", None)
    return repr(str(name) if name else type(metric).__name__)


def non_finite(value: torch.Tensor) -> str | None:
    """What is not finite in ``value`` (``"nan"``, ``"[nan, 1.5]"``), or ``None`` if all is."""
    with torch.no_grad():
        if not value.is_floating_point() or bool(torch.isfinite(value).all()):
            return None
        flat = value.detach().flatten().float().cpu()
        shown = ", ".join(f"{v:.4g}" for v in flat[:8].tolist())
        more = f", ... ({flat.numel()} values)" if flat.numel() > 8 else ""
        return shown if value.ndim == 0 else f"[{shown}{more}]"
