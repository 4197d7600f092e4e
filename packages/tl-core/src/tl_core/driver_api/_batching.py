"""Turn the many spellings of "some prompts" into one padded id tensor with lengths."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tl_core._errors import UserError

__all__ = ["TokenBatch", "pad_batch"]


@dataclass(frozen=True)
class TokenBatch:
    """Padded prompts.

    Attributes:
        ids: ``[batch, pos]`` token ids.
        lengths: Real length of each prompt.
        offsets: Column where each prompt starts (non-zero only with left padding).
    """

    ids: torch.Tensor
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def is_ragged(self) -> bool:
        """Whether any prompt is shorter than the padded width."""
        return any(n != self.ids.shape[1] for n in self.lengths)

    def rows(self) -> list[list[int]]:
        """Each prompt's real ids, padding removed."""
        ids = self.ids.tolist()
        return [row[o : o + n] for row, o, n in zip(ids, self.offsets, self.lengths, strict=True)]

    def attention_mask(self) -> torch.Tensor:
        """``[batch, pos]`` with 1 at real tokens and 0 at padding."""
        cols = torch.arange(self.ids.shape[1], device=self.ids.device)
        starts = torch.tensor(self.offsets, device=self.ids.device)[:, None]
        ends = starts + torch.tensor(self.lengths, device=self.ids.device)[:, None]
        return ((cols >= starts) & (cols < ends)).long()


def pad_batch(
    input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
    *,
    pad_id: int,
    padding_side: Literal["right", "left"] = "right",
    device: torch.device | str | None = None,
) -> TokenBatch:
    """Pad prompts into one tensor.

    A 1-D tensor or flat list is one prompt; a 2-D tensor is a batch of full-length prompts;
    a list of lists is a ragged batch.

    Raises:
        UserError: Empty prompts, non-integer ids, or tensors of the wrong rank.
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise UserError(f"input_ids must hold integer token ids, found dtype {input_ids.dtype}")
        ids = input_ids[None] if input_ids.ndim == 1 else input_ids
        if ids.ndim != 2:
            raise UserError(f"input_ids must be [pos] or [batch, pos], found shape {tuple(input_ids.shape)}")
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise UserError(f"input_ids is empty (shape {tuple(ids.shape)}); pass at least one token")
        ids = ids.long().to(device) if device is not None else ids.long()
        batch, width = ids.shape
        return TokenBatch(ids, (width,) * batch, (0,) * batch)
    rows = _as_rows(input_ids)
    width = max(len(r) for r in rows)
    padded = []
    offsets = []
    for row in rows:
        pad = [pad_id] * (width - len(row))
        padded.append(row + pad if padding_side == "right" else pad + row)
        offsets.append(0 if padding_side == "right" else width - len(row))
    tensor = torch.tensor(padded, dtype=torch.long, device=device)
    return TokenBatch(tensor, tuple(len(r) for r in rows), tuple(offsets))


def _as_rows(input_ids: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(input_ids, (str, bytes)):
        raise UserError("input_ids must be token ids; pass text to the bridge (it tokenizes)")
    items = list(input_ids)
    if not items:
        raise UserError("input_ids is empty; pass at least one prompt")
    nested = [items] if all(_is_int(i) for i in items) else items
    rows: list[list[int]] = []
    for index, row in enumerate(nested):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise UserError(f"prompt {index} of input_ids is {type(row).__name__}, not a list of ids")
        if not row:
            raise UserError(f"prompt {index} of input_ids is empty; every prompt needs a token")
        if not all(_is_int(t) for t in row):
            raise UserError(f"prompt {index} of input_ids holds non-integer values")
        rows.append([int(t) for t in row])
    return rows


def _is_int(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_floating_point
    )
