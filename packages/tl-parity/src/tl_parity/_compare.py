"""Tensor comparison over real (non-padding) positions only."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tl_parity._tolerance import Band
from tl_parity._types import HookComparison, Status

if TYPE_CHECKING:
    import torch

__all__ = ["argmax_agreement", "compare", "reference_mapping", "split_name"]

_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_POS_AXES = ("p", "q", "k")


def split_name(hook: str) -> tuple[int | None, str]:
    """``"blocks.3.attn.hook_z"`` -> ``(3, "attn.hook_z")``; other names -> ``(None, name)``."""
    m = _BLOCK.match(hook)
    return (int(m.group(1)), m.group(2)) if m else (None, hook)


def _real(t: torch.Tensor, layout: str, length: int) -> torch.Tensor:
    """Row ``t`` (batch axis removed) cut to the real positions along every position axis."""
    axes = layout.split()[1:]
    index = tuple(slice(0, length) if ax in _POS_AXES else slice(None) for ax in axes)
    return t[index] if len(axes) == t.dim() else t


def compare(
    hook: str,
    candidate: torch.Tensor | None,
    reference: torch.Tensor | None,
    *,
    layout: str,
    lengths: Sequence[int],
    band: Band,
) -> HookComparison:
    """Compare one hook over the real positions and return its row.

    Args:
        hook: Canonical name (or ``"logits"``).
        candidate: The candidate's tensor, ``None`` when it served none (``MISSING``).
        reference: The reference's tensor, ``None`` when it serves none (``ERROR``).
        layout: The hook's axes (``"b p d"``, ``"b h q k"``, ...): ``p``/``q``/``k`` axes
            are cut to each prompt's length.
        lengths: Real length of each prompt of the right-padded batch.
        band: The tolerance band; integer tensors (token ids) must match exactly.
    """
    import torch

    layer, kind = split_name(hook)

    def row(
        shape: tuple[int, ...],
        dtype: str,
        max_abs: float,
        max_rel: float,
        atol: float,
        rtol: float,
        status: Status,
        diagnostic: str | None = None,
    ) -> HookComparison:
        return HookComparison(
            hook=hook,
            shape=shape,
            dtype=dtype,
            max_abs=max_abs,
            max_rel=max_rel,
            atol=atol,
            rtol=rtol,
            status=status,
            diagnostic=diagnostic,
            layer=layer,
            kind=kind,
        )

    nan = float("nan")
    if candidate is None:
        shape = tuple(reference.shape) if reference is not None else ()
        dtype = str(reference.dtype).removeprefix("torch.") if reference is not None else ""
        return row(
            shape,
            dtype,
            nan,
            nan,
            band.atol_floor,
            band.rtol,
            "MISSING",
            "the candidate served no tensor for it",
        )
    shape = tuple(candidate.shape)
    dtype = str(candidate.dtype).removeprefix("torch.")
    if reference is None:
        return row(
            shape,
            dtype,
            nan,
            nan,
            band.atol_floor,
            band.rtol,
            "ERROR",
            "the reference driver does not serve this hook",
        )
    fixed = [i for i, ax in enumerate(layout.split()) if ax not in _POS_AXES]
    if (
        candidate.dim() != reference.dim()
        or any(i < candidate.dim() and candidate.shape[i] != reference.shape[i] for i in fixed)
        or candidate.shape[0] < len(lengths)
    ):
        return row(
            shape,
            dtype,
            float("inf"),
            float("inf"),
            band.atol_floor,
            band.rtol,
            "ERROR",
            f"shape mismatch: candidate {tuple(candidate.shape)}, reference {tuple(reference.shape)}",
        )
    if not (candidate.is_floating_point() and reference.is_floating_point()):
        band = Band(0.0, 0.0, 0.0)  # token ids and other integers must match exactly
    rows_c: list[torch.Tensor] = []
    rows_r: list[torch.Tensor] = []
    for b, length in enumerate(lengths):
        c = _real(candidate[b], layout, length)
        r = _real(reference[b], layout, length)
        if c.shape != r.shape:  # one side was padded shorter than a prompt
            return row(
                shape,
                dtype,
                float("inf"),
                float("inf"),
                band.atol_floor,
                band.rtol,
                "ERROR",
                f"prompt {b}: real positions {tuple(c.shape)} vs {tuple(r.shape)}",
            )
        rows_c.append(c.double().flatten())
        rows_r.append(r.double().flatten())
    c_all = torch.cat(rows_c) if rows_c else torch.zeros(0, dtype=torch.float64)
    r_all = torch.cat(rows_r) if rows_r else torch.zeros(0, dtype=torch.float64)
    if c_all.numel() == 0:
        return row(shape, dtype, 0.0, 0.0, band.atol_floor, band.rtol, "PASS")
    ref_abs = r_all.abs()
    finite = ref_abs[torch.isfinite(ref_abs)]
    atol = band.atol(float(finite.max()) if finite.numel() else 0.0)
    same = c_all == r_all  # also equal infinities (masked attention scores)
    diff = torch.where(same, torch.zeros_like(c_all), (c_all - r_all).abs())
    max_abs = float(diff.max())
    rel = torch.where(same, torch.zeros_like(diff), diff / (ref_abs + atol))
    max_rel = float(rel.max())
    ok = bool((same | (diff <= atol + band.rtol * ref_abs)).all()) and max_abs == max_abs
    return row(shape, dtype, max_abs, max_rel, atol, band.rtol, "PASS" if ok else "FAIL")


def argmax_agreement(
    candidate: torch.Tensor, reference: torch.Tensor, lengths: Sequence[int]
) -> float:
    """Fraction of real positions where both logits pick the same top token."""
    agree = total = 0
    for b, length in enumerate(lengths):
        c = candidate[b, :length].argmax(-1)
        r = reference[b, :length].argmax(-1)
        agree += int((c == r).sum())
        total += int(length)
    return agree / total if total else 1.0


def reference_mapping(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hook::name`` keys of a results file -> canonical names."""
    return {k.removeprefix("hook::"): v for k, v in tensors.items() if k.startswith("hook::")}
