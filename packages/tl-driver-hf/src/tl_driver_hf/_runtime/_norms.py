"""Recompute a norm's scale and pre-weight value from its input, as the family does.

``hook_scale`` and ``hook_normalized`` are not tensors any transformers norm exposes, so the
driver recomputes them from the norm's input in the norm's compute dtype (float32 for
RMSNorm, and for LayerNorm on half-precision inputs), with the same operations the module
uses. When a hook edits either value, the norm's output is rebuilt from the edited value
with the family's weight rule, so the edit propagates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tl_core import UserError
from tl_core.architecture import NormKind
from tl_core.driver_api import apply_norm_weight, norm_module_eps, norm_statistics

if TYPE_CHECKING:
    from tl_driver_hf._architecture._probe import ModuleCall

__all__ = ["norm_eps", "normalize", "apply_weight", "is_norm_module", "norm_kind_of"]

_KINDS: tuple[NormKind, ...] = ("rms", "rms_weight_first", "rms_plus_one", "layernorm")


def norm_eps(module: nn.Module, kind: NormKind | None = None, width: int | None = None) -> float:
    """The epsilon of a transformers norm module, whatever the family calls it, or measured
    where the family writes it in code (``tl_core.driver_api.norm_module_eps``)."""
    return norm_module_eps(module, kind, width)


def normalize(
    x: torch.Tensor, kind: NormKind, eps: float, *, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, normalized)`` of ``x`` (tl-core's one copy of the norm math,
    ``tl_core.driver_api.norm_statistics``), normalized written into ``out`` if given."""
    return norm_statistics(x, kind, eps, out=out)


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


def is_norm_module(module: nn.Module) -> bool:
    """Whether a module is a norm, by its class name (or a torch ``LayerNorm``)."""
    return "norm" in type(module).__name__.lower() or isinstance(module, nn.LayerNorm)


def norm_kind_of(module: nn.Module, call: ModuleCall | None) -> NormKind | None:
    """Which of tl's norm kinds reproduces the output ``module`` gave in ``call``, if any."""
    if call is None or call.input is None or call.output is None:
        return None
    x = call.input
    if x.shape != call.output.shape:
        return None
    for kind in _KINDS:
        try:
            # An epsilon kept in code, not in an attribute (OLMo), is measured per rule.
            eps = norm_eps(module, kind, x.shape[-1])
        except AttributeError:
            continue
        try:
            _, normed = normalize(x, kind, eps)
            out = apply_weight(normed, module, kind, x.dtype)
        except (RuntimeError, TypeError):
            continue
        if out.shape == call.output.shape and torch.allclose(
            out.double(), call.output.double(), rtol=1e-5, atol=1e-6
        ):
            return kind
    return None
