"""Compile intervention specs to one affine edit ``x * scale + bias`` per hook.

Every spec op is affine (suppress 0/0, scale f/0, add 1/v, set 0/v), and so is any
composition of them, so a whole list of specs on a hook -- and a whole batch of per-prompt
lists -- becomes two tensors that a compiled engine can apply without Python in the loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tl_core._errors import SpecError, TLError
from tl_core.specs._plan import InterventionPlan
from tl_core.specs._specs import InterventionSpec, absolute_positions, listed_positions

__all__ = ["AffineEdit", "compile_plan", "compile_specs"]

_ZERO_SCALE_OPS = ("suppress", "set")


@dataclass(frozen=True, eq=False)
class AffineEdit:
    """The edit ``x -> x * scale + bias``, with ``scale`` and ``bias`` broadcastable to ``x``.

    Attributes:
        scale: Multiplier, broadcastable to the hook's activation.
        bias: Added term, broadcastable to the hook's activation.
        replace: Where ``True`` the output is exactly ``bias`` (the composed scale is 0);
            ``None`` when no scale is 0. Without it ``x * 0`` would turn an infinite
            activation (a masked attention score) into NaN instead of the value set.
    """

    scale: torch.Tensor
    bias: torch.Tensor
    replace: torch.Tensor | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Return the edited activation; differentiable with respect to ``x``.

        Args:
            x: The hook's activation.

        Returns:
            A new tensor ``x * scale + bias`` in ``x``'s dtype and shape.
        """
        scale = self.scale.to(dtype=x.dtype, device=x.device)
        bias = self.bias.to(dtype=x.dtype, device=x.device)
        out = torch.addcmul(bias, x, scale)
        if self.replace is not None:
            out = torch.where(self.replace.to(device=x.device), bias, out)
        return out


def compile_specs(
    specs: Sequence[InterventionSpec],
    *,
    feature_shape: tuple[int, ...],
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> AffineEdit:
    """Compose one prompt's specs on one hook, in order, into a single affine edit.

    Args:
        specs: The specs, first applied first. Negative positions count from ``seq_len``.
        feature_shape: The activation's trailing feature shape; vector values hold
            ``prod(feature_shape)`` numbers.
        seq_len: Length of the position axis the edit will meet.
        dtype: dtype of the returned tensors (composition runs in at least float32).
        device: Device of the returned tensors.

    Returns:
        An edit whose tensors have shape ``()`` (scalar values only, no positions),
        ``feature_shape`` (no positions) or ``(seq_len, *feature_shape)``.

    Raises:
        SpecError: If a value's width does not match ``feature_shape`` or a position is
            outside ``seq_len``.
    """
    work = torch.promote_types(dtype, torch.float32)
    width = math.prod(feature_shape)
    if any(spec.pos is not None for spec in specs):
        shape: tuple[int, ...] = (seq_len, *feature_shape)
    elif any(isinstance(spec.value, tuple) or spec.features is not None for spec in specs):
        shape = feature_shape
    else:
        shape = ()
    scale = torch.ones(shape, dtype=work, device=device)
    bias = torch.zeros(shape, dtype=work, device=device)
    for spec in specs:
        factor = _factor(spec)
        if spec.features is not None:
            _edit_features(spec, scale, bias, factor, width, seq_len, work, device)
            continue
        value = _value_tensor(spec, width, feature_shape, work, device)
        if spec.pos is None:
            bias = bias * factor + value
            scale = scale * factor
            continue
        rows = torch.tensor(
            absolute_positions(listed_positions(spec.pos), seq_len), dtype=torch.long, device=device
        )
        bias[rows] = bias[rows] * factor + value
        scale[rows] = scale[rows] * factor
    return AffineEdit(scale.to(dtype), bias.to(dtype), scale == 0 if _zeroes_scale(specs) else None)


def _edit_features(
    spec: InterventionSpec,
    scale: torch.Tensor,
    bias: torch.Tensor,
    factor: float,
    width: int,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> None:
    """Compose one spec that lists ``features`` into ``scale``/``bias`` in place."""
    features = list(spec.features or ())
    wrong = [f for f in features if not 0 <= f < width]
    if wrong:
        raise SpecError(
            f"{spec.op!r} spec: key 'features' lists feature {wrong[0]}, out of range for "
            f"{width} features (valid indices 0..{width - 1})"
        )
    cols = torch.tensor(features, dtype=torch.long, device=device)
    # One row per position when any spec lists positions, else a single row.
    s2, b2 = scale.view(-1, width), bias.view(-1, width)
    value = _value_tensor(spec, len(features), (len(features),), dtype, device)
    rows = (
        torch.arange(s2.shape[0], device=device)
        if spec.pos is None
        else torch.tensor(
            absolute_positions(listed_positions(spec.pos), seq_len), dtype=torch.long, device=device
        )
    )
    grid = (rows[:, None], cols[None, :])
    b2[grid] = b2[grid] * factor + value
    s2[grid] = s2[grid] * factor


def compile_plan(
    plan: InterventionPlan,
    hook: str,
    *,
    layout: str,
    feature_shape: tuple[int, ...],
    seq_len: int,
    offsets: Sequence[int] | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> AffineEdit | None:
    """Compile every prompt's specs on one hook into one edit for the padded batch.

    Args:
        plan: A plan from ``build_plan``.
        hook: The canonical hook name.
        layout: The hook's axes: ``"b p ..."`` (position axis at dim 1) or ``"b h q k"``
            (attention scores/pattern; feature axis = key position).
        feature_shape: The trailing feature shape; ``(seq_len,)`` for ``"b h q k"``.
        seq_len: Padded sequence length of the batch.
        offsets: Column of each prompt's position 0 (left padding); ``None`` = all 0.
        dtype: dtype of the returned tensors.
        device: Device of the returned tensors.

    Returns:
        ``None`` if no prompt has specs on ``hook``. If every prompt has the same specs
        and none lists positions, the cheap edit of ``compile_specs`` (shape ``()`` or
        ``feature_shape``). Otherwise tensors of shape ``(batch, seq_len, *feature_shape)``
        (``(batch, 1, seq_len, seq_len)`` for ``"b h q k"``), identity outside each
        prompt's edits. A prompt's edits cover its columns from its offset to ``seq_len``
        (so tokens generated after the prompt are edited by specs without ``pos``); on
        ``"b h q k"`` they cover only the prompt's own key columns.

    Raises:
        TLError: If ``layout``, ``feature_shape`` or ``offsets`` do not fit together.
        SpecError: If a spec does not fit the shapes given.
    """
    per_prompt = plan.specs_for(hook)
    if not any(per_prompt):
        return None
    batch = len(per_prompt)
    attention = _check_layout(layout, feature_shape, seq_len)
    starts = [0] * batch if offsets is None else [int(o) for o in offsets]
    if len(starts) != batch or any(not 0 <= o <= seq_len for o in starts):
        raise TLError(
            f"compile_plan({hook!r}): offsets {list(starts)} do not fit a batch of {batch} "
            f"prompt(s) padded to {seq_len}; expected one offset in 0..{seq_len} per prompt"
        )
    lengths = [seq_len - o for o in starts] if plan.lengths is None else list(plan.lengths)
    unpadded = all(o == 0 for o in starts) and all(n == seq_len for n in lengths)
    first = per_prompt[0]
    if (
        all(specs == first for specs in per_prompt)
        and all(spec.pos is None for spec in first)
        and (unpadded or not attention)
    ):
        return compile_specs(
            first, feature_shape=feature_shape, seq_len=seq_len, dtype=dtype, device=device
        )
    work = torch.promote_types(dtype, torch.float32)
    full = (batch, seq_len, *feature_shape)
    scale = torch.ones(full, dtype=work, device=device)
    bias = torch.zeros(full, dtype=work, device=device)
    for b, specs in enumerate(per_prompt):
        if not specs:
            continue
        start = starts[b]
        n = seq_len - start
        block: tuple[int | slice, ...] = (b, slice(start, seq_len))
        if attention:
            # Key columns beyond the prompt (padding, generated tokens) stay untouched;
            # vector values span exactly the prompt's keys.
            keys = min(lengths[b], n)
            edit = compile_specs(specs, feature_shape=(keys,), seq_len=n, dtype=work, device=device)
            block = (*block, slice(start, start + keys))
        else:
            edit = compile_specs(
                specs, feature_shape=feature_shape, seq_len=n, dtype=work, device=device
            )
        scale[block] = edit.scale
        bias[block] = edit.bias
    if attention:
        scale = scale.view(batch, 1, seq_len, seq_len)
        bias = bias.view(batch, 1, seq_len, seq_len)
    replace = scale == 0 if any(_zeroes_scale(specs) for specs in per_prompt) else None
    return AffineEdit(scale.to(dtype), bias.to(dtype), replace)


def _check_layout(layout: str, feature_shape: tuple[int, ...], seq_len: int) -> bool:
    axes = layout.split()
    if axes == ["b", "h", "q", "k"]:
        if tuple(feature_shape) != (seq_len,):
            raise TLError(
                f"compile_plan: layout {layout!r} needs feature_shape ({seq_len},) (the key "
                f"length, equal to seq_len), found {feature_shape}"
            )
        return True
    if axes[:2] != ["b", "p"] or len(axes) - 2 != len(feature_shape):
        raise TLError(
            f"compile_plan: layout {layout!r} does not fit feature_shape {feature_shape}; "
            "expected 'b p' followed by one axis per feature dimension, or 'b h q k'"
        )
    return False


def _factor(spec: InterventionSpec) -> float:
    if spec.op == "scale":
        assert spec.factor is not None
        return spec.factor
    return 1.0 if spec.op == "add" else 0.0


def _zeroes_scale(specs: Sequence[InterventionSpec]) -> bool:
    return any(spec.op in _ZERO_SCALE_OPS or spec.factor == 0 for spec in specs)


def _value_tensor(
    spec: InterventionSpec,
    width: int,
    feature_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor | float:
    value = spec.value
    if value is None:
        return 0.0
    if not isinstance(value, tuple):
        return value
    tensor = torch.tensor(value, dtype=dtype, device=device)
    if tensor.shape[-1] != width:
        raise SpecError(
            f"{spec.op!r} spec: key 'value' has width {tensor.shape[-1]}, expected {width} "
            f"(feature shape {feature_shape})"
        )
    return tensor.reshape(*tensor.shape[:-1], *feature_shape)
