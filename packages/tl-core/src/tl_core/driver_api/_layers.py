"""Block indices given by the user (``start_at_layer``, ``stop_at_layer``), checked once,
and which hooks a forward between them runs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tl_core._errors import UserError
from tl_core.hooks._dictionary_sites import DictionarySite, split_dictionary_name
from tl_core.hooks._vocabulary import BEFORE_BLOCKS, split_canonical

__all__ = ["block_index", "outside_partial", "partial_refusal", "runs_between"]

#: Dictionary sites computed where the dictionary writes (a transcoder's output site).
_AT_OUTPUT = ("hook_sae_error", "hook_sae_output")


def block_index(value: object, name: str, n_layers: int) -> int:
    """``value`` as a block index in ``0..n_layers``; a negative one counts back from the end.

    Args:
        value: What the user passed (``stop_at_layer=-2``, say).
        name: The argument's name, for the error.
        n_layers: The model's block count (``n_layers`` itself is the end of the last block).

    Raises:
        UserError: Not an int, or out of ``-n_layers..n_layers``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{name} must be an int, got {value!r}")
    if not -n_layers <= value <= n_layers:
        raise UserError(
            f"{name}={value} is out of range for a model with {n_layers} blocks; use an int "
            f"from {-n_layers} to {n_layers} (negatives count back from the end)"
        )
    return value + n_layers if value < 0 else value


def _place(name: str, dictionaries: Mapping[str, DictionarySite]) -> float | None:
    """Where a canonical hook fires: ``-1`` before the blocks, its block index, ``inf``
    after the blocks (final norm, unembedding); ``None`` for a name tl cannot place."""
    split = split_dictionary_name(name)
    if split is not None:
        hook, site = split
        dictionary = dictionaries.get(hook)
        if dictionary is not None and site in _AT_OUTPUT:
            hook = dictionary.output_hook
        return _place(hook, dictionaries)
    canonical = split_canonical(name)
    if canonical is None:
        return None
    layer = canonical[1]
    if layer is not None:
        return layer
    return -1 if name in BEFORE_BLOCKS else math.inf


def runs_between(
    name: str,
    start: int | None,
    stop: int | None,
    dictionaries: Mapping[str, DictionarySite] | None = None,
) -> bool:
    """Whether a forward from block ``start`` (``None``: from the tokens) to the input of
    block ``stop`` (``None``: to the logits) runs canonical hook ``name``.

    Dictionary sites fire where their dictionary runs: a transcoder's ``hook_sae_error``
    and ``hook_sae_output`` at the site it writes, the others at the site it reads. A name
    tl cannot place in the forward order counts as run.
    """
    where = _place(name, dictionaries or {})
    if where is None:
        return True
    if start is not None and where < start:
        return False
    return stop is None or where < stop


def outside_partial(
    names: Sequence[str],
    start: int | None,
    stop: int | None,
    dictionaries: Mapping[str, DictionarySite] | None = None,
) -> list[str]:
    """The names of ``names`` that a forward from ``start`` to ``stop`` never runs."""
    return [n for n in names if not runs_between(n, start, stop, dictionaries)]


def partial_refusal(
    missed: Mapping[str, Sequence[str]],
    start: int | None,
    stop: int | None,
    dictionaries: Mapping[str, DictionarySite] | None = None,
) -> UserError:
    """The error for hooks a partial forward never runs, by role (``capture``, ...).

    Args:
        missed: Role (the argument that named them) -> canonical names outside the forward.
        start: The resolved ``start_at_layer`` (or ``None``).
        stop: The resolved ``stop_at_layer`` (or ``None``).
        dictionaries: The attached dictionaries (where their sites fire).
    """
    listed = "; ".join(
        f"{role}: {', '.join(repr(n) for n in names[:6])}"
        + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        for role, names in missed.items()
        if names
    )
    places = [_place(n, dictionaries or {}) for names in missed.values() for n in names]
    reasons, fixes = [], []
    early = [p for p in places if start is not None and p is not None and p < start]
    if early:
        reasons.append(f"start_at_layer={start} begins the forward at block {start}")
        first = min(early)
        fixes.append(
            "leave start_at_layer out (run from the tokens)"
            if first < 0
            else f"start at block {int(first)} or earlier"
        )
    late = [p for p in places if stop is not None and p is not None and p >= stop]
    if late:
        reasons.append(f"stop_at_layer={stop} ends the forward before block {stop}")
        last = max(late)
        fixes.append(
            "leave stop_at_layer out (they run after the last block)"
            if last == math.inf
            else f"stop at block {int(last) + 1} or later"
        )
    return UserError(
        f"{' and '.join(reasons)}, so these hooks never run in it ({listed}); drop them, "
        f"or {' and '.join(fixes)}"
    )
