"""One norm vocabulary and one copy of the norm math, for every driver.

``hook_scale`` and ``hook_normalized`` are not tensors any engine's norm exposes, so drivers
recompute them from the norm's input, in float32 where the norm computes in float32, with
the operations transformers' norms use (multiplying by ``rsqrt``, so RMS norms match bit
for bit). The weight rule says how each kind turns the normalized value into its output;
a driver rebuilds the output with it when a hook edits the scale or the normalized value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the vocabulary is read without torch (adapter tables, support checks)
    import torch

__all__ = ["NORM_KINDS", "NormKind", "apply_norm_weight", "norm_statistics", "normalization_type"]

#: How a norm normalizes and applies its weight (over the last axis):
#: ``"layernorm"``: centred, biased variance, ``normalized * w + b``;
#: ``"rms"``: ``w * normalized.to(input_dtype)`` (Llama);
#: ``"rms_weight_first"``: ``(w * normalized).to(input_dtype)`` (OLMo 2);
#: ``"rms_plus_one"``: ``(normalized * (1 + w)).to(input_dtype)`` (Gemma).
NormKind = Literal["layernorm", "rms", "rms_weight_first", "rms_plus_one"]
NORM_KINDS: tuple[NormKind, ...] = ("layernorm", "rms", "rms_weight_first", "rms_plus_one")
"""Every ``NormKind``."""


def normalization_type(kind: NormKind) -> Literal["LN", "RMS"]:
    """The ``ModelInfo.normalization_type`` of a norm kind."""
    return "LN" if kind == "layernorm" else "RMS"


def norm_statistics(x: torch.Tensor, kind: NormKind, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(centred input, scale, normalized)`` of ``x`` in the norm's compute dtype.

    ``scale`` is ``sqrt(var + eps)`` (``[..., 1]``); ``normalized`` is ``centred *
    rsqrt(var + eps)``. RMS norms compute in float32; LayerNorm in float32 for half-precision
    inputs, else in the input's dtype. The centred input (``x`` itself, in float32, for RMS
    norms) lets an edited scale be applied. ``scale`` and ``normalized`` are fresh tensors
    that hooks may edit in place.
    """
    import torch

    if kind == "layernorm":
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        centred = xf - xf.mean(dim=-1, keepdim=True)
    else:
        centred = x.float()
    var = centred.pow(2).mean(dim=-1, keepdim=True)
    inv = torch.rsqrt(var + eps)
    scale = (var + eps).sqrt()
    if scale.requires_grad:
        # sqrt keeps its output for the backward pass, and hooks may edit the scale in place.
        scale = scale.clone()
    return centred, scale, centred * inv


def apply_norm_weight(
    normalized: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: NormKind,
    input_dtype: torch.dtype,
) -> torch.Tensor:
    """A norm's output from its (possibly edited) normalized value, by the kind's rule."""
    if kind == "layernorm":
        out = normalized
        if weight is not None:
            out = out * weight.to(out.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.to(input_dtype)
    if weight is None:
        return normalized.to(input_dtype)
    if kind == "rms":
        return weight * normalized.to(input_dtype)
    if kind == "rms_weight_first":
        return (weight * normalized).to(input_dtype)
    return (normalized * (1.0 + weight.float())).to(input_dtype)
