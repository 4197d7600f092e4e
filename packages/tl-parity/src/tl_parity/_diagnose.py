"""Name the likely cause of a failed hook: what the candidate's tensor really is.

A parity ``FAIL`` says that a driver's tensor differs from the reference; it does not say
why. The usual causes leave a fingerprint in the reference's *other* sites: a sublayer's
output captured under another sublayer's name, a block index off by one, a norm captured
after its weight instead of before, a missing constant scale (Gemma's ``sqrt(d_model)``
embedding scale), or a head axis transposed. :func:`diagnose` searches for those
fingerprints and returns one sentence naming the cause, or ``None`` when none fits (the
report's own numbers then say everything that is known).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from tl_core.driver_api import split_canonical

if TYPE_CHECKING:
    from tl_core.driver_api import ModelInfo

__all__ = ["DEFAULT_ATOL", "DEFAULT_RTOL", "diagnose"]

#: "≈" means ``max|a - b| <= DEFAULT_RTOL * max|b| + DEFAULT_ATOL``.
DEFAULT_RTOL = 1e-3
DEFAULT_ATOL = 1e-5

#: Norm modules whose ``hook_normalized`` (pre-weight) and ``hook_out`` (post-weight) can slip.
_NORMS = frozenset(
    {"ln1", "ln2", "ln_final", "ln1_post", "ln2_post", "embed_ln", "attn.q_norm", "attn.k_norm"}
)
_SUBLAYER_OUTPUTS = frozenset({"attn.hook_out", "mlp.hook_out"})
#: At most this many other identical sites are listed after the main cause.
_ALSO_SHOWN = 3
#: Per-channel fits need a few rows per channel, or any two rows fit exactly.
_MIN_ROWS = 4


def diagnose(
    hook: str,
    candidate: torch.Tensor,
    reference: Mapping[str, torch.Tensor],
    info: ModelInfo | None = None,
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    lengths: Sequence[int] | None = None,
) -> str | None:
    """Say what a failed candidate tensor actually holds, searching the reference.

    Rules, first match wins: non-finite values; equality with another reference site of the
    same shape (a pre/post-weight slip in a norm, a block off by one or more, a sublayer
    output under another sublayer's name, another site); a constant scale of the
    reference (``sqrt(d_model)``, ``1/sqrt(d_model)``, ``sqrt(d_head)``, ... recognised); for
    a norm's ``hook_normalized``/``hook_out``, a per-channel affine map of the reference
    (the norm's weight and bias applied, or missing); a permutation of the axes (a head
    layout transposed, possibly reshaped afterwards).

    Args:
        hook: The canonical name that failed (``"blocks.3.attn.hook_out"``).
        candidate: The candidate driver's tensor for ``hook``, on the same prompts and
            positions as the reference.
        reference: The reference driver's tensors by canonical name (``hook`` itself and
            as many other sites as were captured; more sites, better diagnoses).
        info: The model's sizes, to recognise ``sqrt(d_model)`` and head layouts; without
            it the widths are read off the tensors.
        rtol: Relative part of the "≈" tolerance (times ``max|reference|``).
        atol: Absolute part of the "≈" tolerance.
        lengths: Real length of each prompt of a right-padded batch: padding positions
            are then ignored (engines fill them differently). ``None``: every position
            counts.

    Returns:
        One sentence naming the cause, or ``None`` when no rule explains the difference.
    """
    if not candidate.is_floating_point():
        return None
    ref = reference.get(hook)
    ref_t = (
        _masked(hook, _plain(ref), lengths) if ref is not None and ref.is_floating_point() else None
    )
    cand = _plain(candidate)
    if ref_t is None or ref_t.shape == cand.shape:  # a wrong layout is masked once restored
        cand = _masked(hook, cand, lengths)
    if ref_t is not None and _close(cand, ref_t, rtol, atol):
        return None  # nothing to explain at this tolerance
    bad = int((~torch.isfinite(cand)).sum())
    if bad and (ref_t is None or ref_t.shape != cand.shape or bool(torch.isfinite(ref_t).all())):
        return f"holds {bad} non-finite value(s) (NaN/inf) where the reference is finite"
    found = _other_site(hook, cand, reference, rtol, atol, lengths)
    if found is not None:
        return found
    if ref_t is None:
        return None
    if ref_t.shape == cand.shape and bool(torch.isfinite(ref_t).all()):
        scaled = _constant_scale(hook, cand, ref_t, info, rtol, atol)
        if scaled is not None:
            return scaled
        affine = _per_channel(hook, cand, ref_t, rtol, atol)
        if affine is not None:
            return affine
    return _permuted(hook, cand, ref_t, rtol, atol, lengths)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    """``a ≈ b``: same shape and ``max|a - b| <= rtol * max|b| + atol``.

    Equal entries count as no difference, so masked ``-inf`` scores agree; NaN never does.
    """
    if a.shape != b.shape or a.numel() == 0:
        return False
    finite = b[torch.isfinite(b)]
    tol = rtol * (float(finite.abs().max()) if finite.numel() else 0.0) + atol
    diff = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
    worst = float(diff.max())
    return worst <= tol  # False for NaN


def _masked(name: str, t: torch.Tensor, lengths: Sequence[int] | None) -> torch.Tensor:
    """``t`` with the padding positions of each prompt set to zero (``lengths`` given)."""
    if lengths is None or t.ndim < 2 or t.shape[0] != len(lengths):
        return t
    split = split_canonical(name)
    if split is None:
        return t
    axes = split[0].layout.split()
    if len(axes) != t.ndim:
        return t
    position_axes = [
        k for k, ax in enumerate(axes) if ax == "p" or (ax in ("q", "k") and "q" in axes)
    ]
    if not position_axes:
        return t
    out = t.clone()
    for row, length in enumerate(lengths):
        for axis in position_axes:
            index: list[slice | int] = [slice(None)] * t.ndim
            index[0] = row
            index[axis] = slice(int(length), None)
            out[tuple(index)] = 0.0
    return out


# -- another site ------------------------------------------------------------------------


def _other_site(
    hook: str,
    cand: torch.Tensor,
    reference: Mapping[str, torch.Tensor],
    rtol: float,
    atol: float,
    lengths: Sequence[int] | None,
) -> str | None:
    # Only same-shape sites can be the served tensor; each check is one vectorised pass.
    matches = [
        name
        for name, t in reference.items()
        if name != hook
        and tuple(t.shape) == tuple(cand.shape)
        and t.is_floating_point()
        and _close(cand, _masked(name, _plain(t), lengths), rtol, atol)
    ]
    if not matches:
        return None
    ranked = sorted(matches, key=lambda site: _rank(hook, site))
    best, others = ranked[0], ranked[1 : 1 + _ALSO_SHOWN]
    sentence = _relation(hook, best)
    if others:
        more = len(ranked) - 1 - len(others)
        listed = ", ".join(others) + (f" and {more} more" if more > 0 else "")
        sentence += f"; the reference holds the same tensor at {listed}"
    return sentence


def _parts(name: str) -> tuple[str, int | None]:
    """``(suffix, layer)``: ``("attn.hook_out", 3)`` for ``blocks.3.attn.hook_out``."""
    split = split_canonical(name)
    if split is None:
        return name, None
    template, layer = split
    return template.suffix, layer


def _norm_of(suffix: str) -> tuple[str, str] | None:
    """``(norm module, leaf)`` for a norm's ``hook_normalized``/``hook_out``, else ``None``."""
    module, _, leaf = suffix.rpartition(".")
    if module in _NORMS and leaf in ("hook_normalized", "hook_out"):
        return module, leaf
    return None


def _rank(hook: str, site: str) -> tuple[int, int, str]:
    """Sort key: the most specific explanation first, then the nearest layer."""
    suffix, layer = _parts(hook)
    other_suffix, other_layer = _parts(site)
    distance = abs((other_layer or 0) - (layer or 0))
    norm, other_norm = _norm_of(suffix), _norm_of(other_suffix)
    if norm and other_norm and norm[0] == other_norm[0] and layer == other_layer:
        return 0, 0, site
    if suffix == other_suffix and layer is not None and other_layer is not None:
        return 1, distance, site
    if layer == other_layer and suffix in _SUBLAYER_OUTPUTS and other_suffix in _SUBLAYER_OUTPUTS:
        return 2, 0, site
    if layer == other_layer:
        return 3, 0, site
    return 4, distance, site


def _relation(hook: str, site: str) -> str:
    """One sentence: ``hook`` serves the reference's ``site``, and what that slip is."""
    suffix, layer = _parts(hook)
    other_suffix, other_layer = _parts(site)
    norm, other_norm = _norm_of(suffix), _norm_of(other_suffix)
    if norm and other_norm and norm[0] == other_norm[0] and layer == other_layer:
        if norm[1] == "hook_normalized":
            return (
                f"serves {site}, the norm's post-weight output (a pre/post-weight slip): "
                f"hook_normalized must be the value before the norm's weight and bias"
            )
        return (
            f"serves {site}, the norm's pre-weight value (a pre/post-weight slip): "
            f"hook_out must be the value after the norm's weight and bias"
        )
    if suffix == other_suffix and layer is not None and other_layer is not None:
        step = other_layer - layer
        direction = "later" if step > 0 else "earlier"
        if abs(step) == 1:
            return f"off by one layer: serves {site} (one block {direction})"
        return f"off by {abs(step)} layers: serves {site} ({abs(step)} blocks {direction})"
    if layer == other_layer and suffix in _SUBLAYER_OUTPUTS and other_suffix in _SUBLAYER_OUTPUTS:
        return f"serves {site} (a sublayer output under another sublayer's name)"
    module, _, leaf = suffix.rpartition(".")
    other_module, _, other_leaf = other_suffix.rpartition(".")
    if (
        layer == other_layer
        and module == other_module
        and {leaf, other_leaf} == {"hook_in", "hook_out"}
    ):
        what = "input, not its output" if leaf == "hook_out" else "output, not its input"
        return f"serves {site} (the site's {what})"
    return f"serves {site} (the tensor of another site)"


# -- scales -------------------------------------------------------------------------------


def _constant_scale(
    hook: str,
    cand: torch.Tensor,
    ref: torch.Tensor,
    info: ModelInfo | None,
    rtol: float,
    atol: float,
) -> str | None:
    denominator = float((ref * ref).sum())
    if denominator == 0.0:
        return None
    c = float((cand * ref).sum()) / denominator  # least squares: argmin_c |cand - c*ref|
    if abs(c - 1.0) <= max(10 * rtol, 1e-6) or not _close(cand, c * ref, rtol, atol):
        return None
    d_model = info.d_model if info is not None else int(ref.shape[-1])
    known: list[tuple[float, str]] = [
        (math.sqrt(d_model), f"sqrt(d_model) (d_model={d_model})"),
        (1 / math.sqrt(d_model), f"1/sqrt(d_model) (d_model={d_model})"),
        (float(d_model), "d_model"),
        (1 / d_model, "1/d_model"),
        (-1.0, "-1 (a sign flip)"),
    ]
    if info is not None:
        known += [
            (math.sqrt(info.d_head), f"sqrt(d_head) (d_head={info.d_head})"),
            (1 / math.sqrt(info.d_head), f"1/sqrt(d_head) (d_head={info.d_head})"),
        ]
    label = next(
        (name for value, name in known if abs(c / value - 1.0) <= max(1e-3, 10 * rtol)), None
    )
    sentence = f"is the reference times a constant scale c = {c:.6g}"
    if label is None:
        return sentence
    sentence += f" = {label}"
    if hook == "embed.hook_out" and label.startswith("1/sqrt(d_model)"):
        sentence += (
            ": the embedding's sqrt(d_model) scale is missing (Gemma scales its embedding "
            "by sqrt(d_model) before the first block)"
        )
    elif hook == "embed.hook_out" and label.startswith("sqrt(d_model)"):
        sentence += ": the embedding's sqrt(d_model) scale is applied twice"
    return sentence


def _per_channel(
    hook: str, cand: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float
) -> str | None:
    """A norm's weight (and bias) applied where it must not be, or missing where it must."""
    norm = _norm_of(_parts(hook)[0])
    if norm is None or cand.ndim < 2:
        return None
    x = ref.reshape(-1, ref.shape[-1])
    y = cand.reshape(-1, cand.shape[-1])
    if x.shape[0] < _MIN_ROWS:
        return None
    # Per-channel least squares y = w*x + b, all channels at once.
    xm, ym = x.mean(0), y.mean(0)
    var = ((x - xm) ** 2).sum(0)
    if bool((var == 0).any()):
        return None
    w = ((x - xm) * (y - ym)).sum(0) / var
    b = ym - w * xm
    if not _close(y, w * x + b, rtol, atol):
        return None
    has_bias = float(b.abs().max()) > rtol * float(y.abs().max()) + atol
    what = "a per-channel weight" + (" and bias" if has_bias else "")
    if norm[1] == "hook_normalized":
        return (
            f"is the reference times {what} (a pre/post-weight slip): the norm's weight was "
            f"applied, so this is the post-weight output, not hook_normalized"
        )
    return (
        f"differs from the reference by {what} (a pre/post-weight slip): the norm's weight "
        f"is missing, so this is the pre-weight value, not the post-weight hook_out"
    )


# -- layouts ------------------------------------------------------------------------------


def _permuted(
    hook: str,
    cand: torch.Tensor,
    ref: torch.Tensor,
    rtol: float,
    atol: float,
    lengths: Sequence[int] | None,
) -> str | None:
    """The reference with its axes in another order (transposed, or transposed then reshaped)."""
    if cand.numel() != ref.numel() or ref.ndim < 2 or ref.ndim > 5:
        return None
    split = split_canonical(hook)
    axes = split[0].layout.split() if split is not None else []
    if len(axes) != ref.ndim:
        axes = [f"axis{k}" for k in range(ref.ndim)]
    for perm in _perms(tuple(ref.shape)):
        held = [ref.shape[j] for j in perm]
        restored = _masked(hook, cand.reshape(held).permute(*_inverse(perm)), lengths)
        if _close(restored, ref, rtol, atol):
            holds = " ".join(axes[j] for j in perm)
            expected = " ".join(axes)
            how = "transposed" if list(cand.shape) == held else "transposed, then reshaped"
            return (
                f"holds the reference with its axes as '{holds}' where '{expected}' is "
                f"expected (a {how} layout)"
            )
    return None


def _perms(shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Axis orders worth trying, fewest moved axes first; size-1 axes stay put (no data)."""
    n = len(shape)
    keep = [k for k in range(n) if shape[k] == 1]
    out = [
        p
        for p in itertools.permutations(range(n))
        if any(p[k] != k for k in range(n)) and all(p[k] == k for k in keep)
    ]
    return sorted(out, key=lambda p: sum(p[k] != k for k in range(n)))


def _inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for k, j in enumerate(perm):
        inv[j] = k
    return inv
