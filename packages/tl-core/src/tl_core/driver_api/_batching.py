"""Turn the many spellings of "some prompts" into one padded id tensor with lengths."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tl_core._errors import UserError

__all__ = ["TokenBatch", "check_token_range", "describe_value", "pad_batch"]


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

    def to(self, device: torch.device | str) -> TokenBatch:
        """The same batch with its ids on ``device``."""
        ids = self.ids.to(device)
        return self if ids is self.ids else TokenBatch(ids, self.lengths, self.offsets)

    def repadded(self, padding_side: Literal["right", "left"], pad_id: int) -> TokenBatch:
        """The same prompts padded on ``padding_side`` with ``pad_id`` (no re-validation)."""
        width = self.ids.shape[1]
        ids = torch.full_like(self.ids, pad_id)
        offsets = tuple(0 if padding_side == "right" else width - n for n in self.lengths)
        for row, (old, new, n) in enumerate(zip(self.offsets, offsets, self.lengths, strict=True)):
            ids[row, new : new + n] = self.ids[row, old : old + n]
        return TokenBatch(ids, self.lengths, offsets)

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
    a list of lists (or of 1-D tensors) is a ragged batch.

    Raises:
        UserError: Empty prompts, ids that are not ints (naming the prompt and position),
            rows that are not lists, or tensors of the wrong dtype or rank.
    """
    if isinstance(input_ids, torch.Tensor):
        if _bad_dtype(input_ids):
            raise UserError(
                f"token ids must be an integer tensor, found dtype {input_ids.dtype}; convert "
                f"real token ids with ids.long(), or pass text to the bridge (it tokenizes)"
            )
        ids = input_ids[None] if input_ids.ndim == 1 else input_ids
        if ids.ndim != 2:
            raise UserError(
                f"token ids must be a [pos] or [batch, pos] tensor, found shape "
                f"{tuple(input_ids.shape)}"
            )
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise UserError(
                f"the token-id tensor is empty (shape {tuple(ids.shape)}); pass at least one token"
            )
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


def check_token_range(batch: TokenBatch, d_vocab: int) -> None:
    """Refuse token ids outside ``0..d_vocab-1`` (padding is not checked).

    An id outside the embedding would fail inside the model with an index error, or on a
    GPU with a device-side assert that poisons the process.

    Raises:
        UserError: Naming the first bad id, its prompt and its position.
    """
    ids = batch.ids
    bad = ((ids < 0) | (ids >= d_vocab)) & batch.attention_mask().bool()
    if not bool(bad.any()):
        return
    row, col = (int(i) for i in bad.nonzero()[0])
    value = int(ids[row, col])
    count = int(bad.sum())
    why = (
        "token ids are never negative (a -100 label mask or a -1 pad marker is not an input id)"
        if value < 0
        else "were these ids made by another model's tokenizer?"
    )
    more = f" ({count} ids are out of range in all)" if count > 1 else ""
    raise UserError(
        f"prompt {row}, position {col - batch.offsets[row]}: token id {value} is outside "
        f"this model's vocabulary, ids 0 to {d_vocab - 1} (d_vocab={d_vocab}){more}; {why}"
    )


def _as_rows(input_ids: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(input_ids, (str, bytes)):
        raise UserError("token ids must be ints, not text; pass text to the bridge (it tokenizes)")
    if not isinstance(input_ids, Sequence):
        hint = (
            " (convert an array with torch.as_tensor(ids))"
            if hasattr(input_ids, "__array__")
            else ""
        )
        raise UserError(
            f"token ids must be a list of ints, a list of such lists, or a tensor; got "
            f"{describe_value(input_ids)}{hint}"
        )
    items: list[Any] = list(input_ids)
    if not items:
        raise UserError("the list of token ids is empty; pass at least one prompt")
    # Any list (or 1-D tensor) among the items makes this a batch; else it is one prompt.
    nested = any(_is_row(item) for item in items)
    rows: list[list[int]] = []
    for index, row in enumerate(items if nested else [items]):
        if isinstance(row, torch.Tensor):
            if row.ndim != 1 or _bad_dtype(row):
                raise UserError(
                    f"prompt {index} is {describe_value(row)}; a prompt of token ids is a 1-D "
                    f"integer tensor or a list of ints"
                )
            row = row.tolist()
        elif not _is_row(row):
            raise UserError(
                f"prompt {index} is {describe_value(row)}, not a list of token ids; a batch of "
                f"token ids is a list of lists of ints, e.g. [[1, 2, 3], [4, 5]]"
            )
        if not row:
            raise UserError(
                f"prompt {index} is an empty list of token ids; every prompt needs a token"
            )
        for position, token in enumerate(row):
            if not _is_int(token):
                raise UserError(
                    f"prompt {index}, position {position}: {describe_value(token)} is not a token "
                    f"id; token ids are ints (not floats, bools or None)"
                )
        rows.append([int(t) for t in row])
    return rows


def _is_row(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim >= 1  # a row, or a tensor of the wrong rank refused as one
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _bad_dtype(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool


def _is_int(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not _bad_dtype(value)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def describe_value(value: object) -> str:
    """``None``, a tensor's shape and dtype, or a value's type and short repr (for messages)."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{type(value).__name__} {text}"
