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
from tl_core.driver_api import NormKind, apply_norm_weight, norm_module_eps, norm_statistics

__all__ = ["norm_eps", "normalize", "apply_weight"]


def norm_eps(module: nn.Module, kind: NormKind | None = None, width: int | None = None) -> float:
    """The epsilon of a transformers norm module, whatever the family calls it, or measured
    where the family writes it in code (``tl_core.driver_api.norm_module_eps``)."""
    return norm_module_eps(module, kind, width)


def normalize(
    x: torch.Tensor, kind: NormKind, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(centred input, scale, normalized)`` of ``x`` (tl-core's one copy of the norm math,
    ``tl_core.driver_api.norm_statistics``)."""
    return norm_statistics(x, kind, eps)


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
    return apply_norm_weight(normalized, weight, bias, kind, input_dtype)
