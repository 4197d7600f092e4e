"""Tensor helpers of the residual-stream analysis: position slicing, normalisation, readout.

Conventions are those of ``tl_core.cache._resid_analysis``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch

from tl_core._errors import UserError
from tl_core.cache._readout import ModelReadout

__all__ = [
    "DEFAULT_EPS",
    "NormType",
    "Plan",
    "PosSlice",
    "accumulated_plan",
    "broadcasts_to",
    "check_position",
    "decompose_plan",
    "logit_directions",
    "normalize_components",
    "readout_logits",
    "recompute_scale",
    "normalize_layer",
    "slice_positions",
    "token_index",
]

PosSlice: TypeAlias = int | slice | Sequence[int] | None
"""Positions to keep: ``None`` (all), a ``slice``, a list of indices, or one ``int``
(which drops the position dimension)."""

NormType: TypeAlias = Literal["LN", "RMS"] | None
Plan: TypeAlias = list[tuple[str, str]]
"""``(label, canonical hook name)`` pairs, in stacking order."""

DEFAULT_EPS = 1e-5


def normalize_layer(layer: int | None, n_layers: int, *, method: str) -> int:
    """Map a ``layer`` argument to ``0 .. n_layers`` (``n_layers`` = final residual)."""
    if layer is None:
        return n_layers
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise UserError(f"{method}: layer must be an int or None, got {layer!r}.")
    resolved = layer + n_layers + 1 if layer < 0 else layer
    if not 0 <= resolved <= n_layers:
        raise UserError(
            f"{method}: layer={layer!r} is out of range for a model with {n_layers} layers; "
            f"expected 0..{n_layers} ({n_layers} or -1 = the final residual) or a negative "
            f"index down to {-(n_layers + 1)}."
        )
    return resolved


def slice_positions(
    tensor: torch.Tensor,
    pos_slice: PosSlice,
    dim: int,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """Select positions along ``dim``.

    Args:
        tensor: Any tensor with a position dimension.
        pos_slice: ``None`` keeps all; a ``slice`` or a list of indices keeps the dimension;
            an ``int`` selects one position and drops the dimension.
        dim: The position dimension (non-negative).
        lengths: Each prompt's real length when the rows are right-padded prompts of
            different lengths (batch at dimension 0, positions at 1). Positions then count
            within each prompt (negatives from its own end), so no prompt is read at its
            padding; ``None`` and a slice over every column keep the padded tensor.

    Returns:
        The selected positions (a view for ``int`` and ``slice`` without ragged ``lengths``).

    Raises:
        UserError: An index is out of range (for any prompt, with ``lengths``), a slice
            that selects a different number of positions from different prompts, or
            ``pos_slice`` has the wrong type.
    """
    if pos_slice is None:
        return tensor
    size = tensor.shape[dim]
    if lengths is not None and dim == 1 and any(n != size for n in lengths):
        return _per_prompt(tensor, pos_slice, list(lengths))
    if isinstance(pos_slice, slice):
        return tensor[(slice(None),) * dim + (pos_slice,)]
    if isinstance(pos_slice, int) and not isinstance(pos_slice, bool):
        check_position(pos_slice, size)
        return tensor.select(dim, pos_slice)
    indices = _index_list(pos_slice)
    for index in indices:
        check_position(index, size)
    wrapped = torch.tensor([i % size for i in indices], dtype=torch.long, device=tensor.device)
    return tensor.index_select(dim, wrapped)


def _index_list(pos_slice: object) -> list[int]:
    if isinstance(pos_slice, Sequence) and not isinstance(pos_slice, str):
        indices = list(pos_slice)
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, int):
                raise UserError(f"pos_slice must hold ints, got {index!r} in {pos_slice!r}.")
        return indices
    raise UserError(
        f"pos_slice must be None, an int, a slice or a list of ints, got {pos_slice!r}."
    )


def _per_prompt(tensor: torch.Tensor, pos_slice: PosSlice, lengths: list[int]) -> torch.Tensor:
    """``pos_slice`` read within each prompt of a right-padded ragged batch."""
    width = tensor.shape[1]
    single = isinstance(pos_slice, int) and not isinstance(pos_slice, bool)
    if isinstance(pos_slice, slice):
        if pos_slice.indices(width) == (0, width, 1):
            return tensor  # every column, as ``None``
        chosen = [list(range(n))[pos_slice] for n in lengths]
        counts = {len(c) for c in chosen}
        if len(counts) > 1:
            raise UserError(
                f"pos_slice={pos_slice!r} selects {[len(c) for c in chosen]} positions from "
                f"prompts of lengths {lengths}, which do not stack; counted within each "
                "prompt, a slice must select as many positions from every prompt. Pass a "
                "list of positions, or take one prompt with cache.prompt(i)."
            )
        rows = chosen
    else:
        wanted = (
            [pos_slice]
            if isinstance(pos_slice, int) and not isinstance(pos_slice, bool)
            else _index_list(pos_slice)
        )
        rows = []
        for prompt, length in enumerate(lengths):
            row = []
            for index in wanted:
                if not -length <= index < length:
                    raise UserError(
                        f"pos_slice index {index} is out of range for prompt {prompt}, which "
                        f"has {length} real tokens (valid: {-length}..{length - 1}; in a "
                        "batch of prompts of different lengths positions count within each "
                        "prompt, negatives from its own end)."
                    )
                row.append(index % length)
            rows.append(row)
    columns = torch.tensor(rows, dtype=torch.long, device=tensor.device)
    batch = torch.arange(tensor.shape[0], device=tensor.device)[:, None]
    picked = tensor[batch, columns]
    return picked[:, 0] if single else picked


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target``."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(shape[::-1], target[::-1], strict=False))


def check_position(index: int, size: int) -> None:
    if not -size <= index < size:
        raise UserError(
            f"pos_slice index {index} is out of range for {size} positions "
            f"(valid: {-size}..{size - 1})."
        )


def accumulated_plan(
    n_layers: int, layer: int, *, incl_mid: bool, mlp_input: bool, parallel: bool
) -> Plan:
    """``(label, hook)`` pairs of ``accumulated_resid``, in forward order."""
    plan: Plan = []
    for index in range(layer + 1):
        if index == n_layers:
            plan.append(("final_post", f"blocks.{n_layers - 1}.hook_out"))
            break
        plan.append((f"{index}_pre", f"blocks.{index}.hook_in"))
        wants_mid = (incl_mid and index < layer) or (mlp_input and index == layer)
        if wants_mid and not parallel:
            plan.append((f"{index}_mid", f"blocks.{index}.ln2.hook_in"))
    return plan


def decompose_plan(
    layer: int,
    *,
    embeds: Plan,
    mode: str,
    mlp_input: bool,
    sandwich: bool,
    parallel: bool,
) -> Plan:
    """``(label, hook)`` pairs of ``decompose_resid``, in forward order."""
    if mode not in ("all", "attn", "mlp"):
        raise UserError(f"decompose_resid: mode must be 'all', 'attn' or 'mlp', got {mode!r}.")
    attn_suffix = "ln1_post.hook_out" if sandwich else "attn.hook_out"
    mlp_suffix = "ln2_post.hook_out" if sandwich else "mlp.hook_out"
    plan = list(embeds)
    for index in range(layer):
        if mode != "mlp":
            plan.append((f"{index}_attn_out", f"blocks.{index}.{attn_suffix}"))
        if mode != "attn":
            plan.append((f"{index}_mlp_out", f"blocks.{index}.{mlp_suffix}"))
    if mlp_input and mode != "mlp" and not parallel:
        plan.append((f"{layer}_attn_out", f"blocks.{layer}.{attn_suffix}"))
    return plan


def normalize_components(
    stack: torch.Tensor, scale: torch.Tensor, normalization_type: NormType
) -> torch.Tensor:
    """Apply a norm with a fixed ``scale`` to each component of a stack.

    With the scale held fixed, LayerNorm and RMSNorm are linear, so the normalised
    components sum to the normalised total.

    Args:
        stack: ``[..., d_model]`` components.
        scale: The norm's scale (``sqrt(var + eps)`` or ``sqrt(mean(x^2) + eps)``),
            broadcastable to ``stack`` with a trailing size-1 dimension.
        normalization_type: ``"LN"`` centres each component first; ``"RMS"`` only divides;
            ``None`` returns the stack unchanged.

    Returns:
        The normalised (pre-weight) components.
    """
    if normalization_type is None:
        return stack
    if normalization_type == "LN":
        stack = stack - stack.mean(dim=-1, keepdim=True)
    return stack / scale


def recompute_scale(total: torch.Tensor, normalization_type: NormType, eps: float) -> torch.Tensor:
    """The scale a LayerNorm (``"LN"``) or RMSNorm (``"RMS"``) would compute for ``total``.

    Args:
        total: ``[..., d_model]`` residual vectors.
        normalization_type: The norm family; ``None`` gives a scale of one.
        eps: The norm's epsilon.

    Returns:
        ``[..., 1]`` scales.
    """
    if normalization_type is None:
        return torch.ones_like(total[..., :1])
    if normalization_type == "LN":
        total = total - total.mean(dim=-1, keepdim=True)
    return (total.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt()


def readout_logits(residual: torch.Tensor, readout: ModelReadout) -> torch.Tensor:
    """Logits for residual vectors: final norm (own statistics), weight, bias, ``W_U``, ``b_U``.

    Args:
        residual: ``[..., d_model]``; each vector is normalised with its own statistics.
        readout: The final norm and unembedding.

    Returns:
        ``[..., d_vocab]`` logits, soft-capped when the readout says so.
    """
    norm = readout.normalization_type
    x = normalize_components(residual, recompute_scale(residual, norm, readout.eps), norm)
    if readout.ln_final_weight is not None:
        x = x * readout.ln_final_weight.to(residual)
    if readout.ln_final_bias is not None:
        x = x + readout.ln_final_bias.to(residual)
    logits = x @ readout.W_U.to(residual)
    if readout.b_U is not None:
        logits = logits + readout.b_U.to(residual)
    if readout.logit_softcap is not None:
        logits = readout.logit_softcap * torch.tanh(logits / readout.logit_softcap)
    return logits


def token_index(
    tokens: int | torch.Tensor | Sequence[int], d_vocab: int, what: str
) -> torch.Tensor:
    if isinstance(tokens, bool):
        raise UserError(f"logit_attrs: {what} must be token ids, got {tokens!r}.")
    index = torch.as_tensor(tokens)
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise UserError(f"logit_attrs: {what} must be integer token ids, got dtype {index.dtype}.")
    index = index.long()
    bad = (index < 0) | (index >= d_vocab)
    if bool(bad.any()):
        raise UserError(
            f"logit_attrs: {what} holds id {int(index[bad].flatten()[0])}, outside the "
            f"vocabulary 0..{d_vocab - 1}."
        )
    return index


def logit_directions(
    readout: ModelReadout,
    tokens: int | torch.Tensor | Sequence[int],
    incorrect_tokens: int | torch.Tensor | Sequence[int] | None,
    *,
    like: torch.Tensor,
) -> torch.Tensor:
    """Residual-space directions whose dot product with a normalised residual gives a logit.

    The direction of token ``t`` is ``ln_final_weight * W_U[:, t]``; with
    ``incorrect_tokens`` it is the difference of the two directions.

    Args:
        readout: The final norm and unembedding.
        tokens: One id or a tensor of ids.
        incorrect_tokens: Ids to subtract (same or broadcastable shape), or ``None``.
        like: Tensor whose device and dtype the result takes.

    Returns:
        ``[*token_shape, d_model]`` directions.

    Raises:
        UserError: Ids that are not integers or lie outside the vocabulary.
    """
    w_u = readout.W_U
    directions = w_u[:, token_index(tokens, w_u.shape[1], "tokens").to(w_u.device)]
    directions = directions.movedim(0, -1)
    if incorrect_tokens is not None:
        index = token_index(incorrect_tokens, w_u.shape[1], "incorrect_tokens")
        other = w_u[:, index.to(w_u.device)].movedim(0, -1)
        try:
            directions = directions - other
        except RuntimeError:
            raise UserError(
                f"logit_attrs: tokens (shape {tuple(directions.shape[:-1])}) and "
                f"incorrect_tokens (shape {tuple(other.shape[:-1])}) must have the same or "
                "broadcastable shapes."
            ) from None
    directions = directions.to(device=like.device, dtype=like.dtype)
    if readout.ln_final_weight is not None:
        directions = directions * readout.ln_final_weight.to(device=like.device, dtype=like.dtype)
    return directions
