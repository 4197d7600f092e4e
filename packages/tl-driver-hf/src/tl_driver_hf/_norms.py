"""Recompute a norm's scale and pre-weight value from its input, as the family does.

``hook_scale`` and ``hook_normalized`` are not tensors any transformers norm exposes, so the
driver recomputes them from the norm's input in the norm's compute dtype (float32 for
RMSNorm, and for LayerNorm on half-precision inputs), with the same operations the module
uses. When a hook edits either value, the norm's output is rebuilt from the edited value
with the family's weight rule, so the edit propagates.
"""

from __future__ import annotations

import torch
from torch import nn

from tl_core import UserError
from tl_driver_hf.adapters import NormKind

__all__ = ["norm_eps", "normalize", "apply_weight"]


def norm_eps(module: nn.Module) -> float:
    """The epsilon of a transformers norm module, whatever the family calls it."""
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise AttributeError(f"cannot find the epsilon of norm module {type(module).__name__}")


def normalize(
    x: torch.Tensor, kind: NormKind, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(centred input, scale, normalized)`` of ``x`` in the norm's compute dtype.

    ``scale`` is ``sqrt(var + eps)`` (``[..., 1]``); ``normalized`` is computed as the
    module does (multiplying by ``rsqrt``), so it matches the module bit for bit on RMS
    norms. The centred input (``x`` itself for RMS norms) lets an edited scale be applied.
    ``scale`` and ``normalized`` are fresh tensors that hooks may edit in place.
    """
    if kind == "layernorm":
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        centred = xf - xf.mean(dim=-1, keepdim=True)
        var = centred.pow(2).mean(dim=-1, keepdim=True)
    else:
        centred = x.float()
        var = centred.pow(2).mean(dim=-1, keepdim=True)
    inv = torch.rsqrt(var + eps)
    scale = (var + eps).sqrt()
    if scale.requires_grad:
        # sqrt keeps its output for the backward pass, and hooks may edit the scale in place.
        scale = scale.clone()
    return centred, scale, centred * inv


def apply_weight(
    normalized: torch.Tensor, module: nn.Module, kind: NormKind, input_dtype: torch.dtype
) -> torch.Tensor:
    """The norm's output from its (possibly edited) pre-weight value."""
    weight: torch.Tensor | None = getattr(module, "weight", None)
    bias: torch.Tensor | None = getattr(module, "bias", None)
    if weight is not None and weight.is_meta:
        raise UserError(
            f"cannot rebuild the output of the offloaded norm {type(module).__name__} after an "
            f"edit of its hook_scale/hook_normalized: its weight is on disk, not in memory. "
            f"Keep norms in memory (device_map) to edit them."
        )
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
