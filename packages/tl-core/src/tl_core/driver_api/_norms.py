"""One copy of the norm math, for every driver (the vocabulary, ``NormKind``, is
``tl_core.architecture``'s).

``hook_scale`` and ``hook_normalized`` are not tensors any engine's norm exposes, so drivers
recompute them from the norm's input, in float32 where the norm computes in float32, with
the operations transformers' norms use (multiplying by ``rsqrt``, so RMS norms match bit
for bit). The weight rule says how each kind turns the normalized value into its output;
a driver rebuilds the output with it when a hook edits the scale or the normalized value.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from tl_core.architecture._vocabulary import NormKind

if TYPE_CHECKING:  # the vocabulary is read without torch (adapter tables, support checks)
    import torch

__all__ = [
    "apply_norm_weight",
    "centred_input",
    "norm_module_eps",
    "norm_statistics",
]


def norm_statistics(
    x: torch.Tensor, kind: NormKind, eps: float, *, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, normalized)`` of ``x`` in the norm's compute dtype.

    ``scale`` is ``sqrt(var + eps)`` (``[..., 1]``); ``normalized`` is the centred input
    times ``rsqrt(var + eps)``. RMS norms compute in float32, with transformers' operations,
    so they match its RMS norms bit for bit; LayerNorm computes in float32 for half-precision
    inputs, else in the input's dtype, with torch's fused kernel, whose statistics give the
    scale without gradients (a tenth of the step-by-step formula's time, paid by every norm
    of a forward that captures ``hook_normalized``; with gradients the scale comes from the
    formula and may differ from the fused one in the last bit). Both are fresh tensors that
    hooks may edit in place.

    ``out``, a tensor of ``x``'s shape in the compute dtype, receives ``normalized`` (the
    same bits; a driver's reusable buffer) where no gradient is recorded; it is ignored
    otherwise. An RMS norm writes it in its own pass; LayerNorm's fused kernel has no such
    form (torch computes, then copies: twice the time of the fused kernel alone).
    """
    import torch

    if out is not None and (x.requires_grad and torch.is_grad_enabled()):
        out = None  # autograd does not record writes into ``out``
    if kind == "layernorm":
        xf = _layernorm_input(x)
        # Unit weights: the same bits as no weights, and the kernel's faster path
        # (0.13 ms against 0.21 ms on a [8, 128, 768] float32 input here).
        ones, zeros = _unit_affine(xf)
        if out is not None:
            _, _, rstd = torch.ops.aten.native_layer_norm.out(
                xf, xf.shape[-1:], ones, zeros, eps,
                out0=out, out1=xf.new_empty(0), out2=xf.new_empty(0),
            )  # fmt: skip
            return rstd.reciprocal(), out
        normalized, _, rstd = torch.native_layer_norm(xf, xf.shape[-1:], ones, zeros, eps)
        if not normalized.requires_grad:
            return rstd.reciprocal(), normalized
        # The fused kernel's statistics carry no gradient; the scale's comes from the formula.
        var = centred_input(x, kind).pow(2).mean(dim=-1, keepdim=True)
    else:
        xf = x.float()
        var = xf.pow(2).mean(dim=-1, keepdim=True)
        rstd = torch.rsqrt(var + eps)
        normalized = xf * rstd if out is None else torch.mul(xf, rstd, out=out)
    scale = (var + eps).sqrt()
    if scale.requires_grad:
        # sqrt keeps its output for the backward pass, and hooks may edit the scale in place.
        scale = scale.clone()
    return scale, normalized


def centred_input(x: torch.Tensor, kind: NormKind) -> torch.Tensor:
    """The input a norm divides by its scale, in its compute dtype: ``x`` minus its mean for
    LayerNorm, ``x`` itself (in float32) for RMS norms. ``centred_input(x) / scale`` is
    ``normalized``, which is how a driver applies an edited ``hook_scale``."""
    if kind == "layernorm":
        xf = _layernorm_input(x)
        return xf - xf.mean(dim=-1, keepdim=True)
    return x.float()


def _unit_affine(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of ones and biases of zeros for a LayerNorm over ``x``'s last axis.

    Made per call (two small tensors): a kept pair made under ``torch.inference_mode``
    (a vLLM worker) could not be saved for backward by a later call with gradients.
    """
    import torch

    ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return ones, torch.zeros_like(ones)


def _layernorm_input(x: torch.Tensor) -> torch.Tensor:
    import torch

    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


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


#: Epsilons measured on norm modules that keep theirs in code rather than in an attribute
#: (OLMo's LayerNorm), weakly keyed so a freed model frees its entries.
_MEASURED: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

#: The epsilons transformers' and vLLM's norms use, most common first.
_CANDIDATE_EPS = (1e-5, 1e-6, 1e-8, 1e-12, 1e-7, 1e-4, 1e-3, 1e-2)

_EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")


def norm_module_eps(module: Any, kind: NormKind | None = None, width: int | None = None) -> float:
    """The epsilon a norm module adds to the variance.

    Read from the module's attribute (``variance_epsilon``, ``eps`` or ``epsilon``). A norm
    that writes its epsilon in its forward instead (OLMo's LayerNorm) is measured, given its
    ``kind`` and ``width`` (used where the module keeps no width of its own): the module
    runs on an input of variance 1e-8, where every common epsilon moves the output by far
    more than float32 rounding, so at most one matches; the match is remembered for the
    module.

    Raises:
        AttributeError: No attribute, and no common epsilon reproduces the module's output
            (or ``kind``/``width`` were not given).
    """
    for name in _EPS_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    if module in _MEASURED:
        return _MEASURED[module]
    if kind is None or width is None:
        raise AttributeError(
            f"norm module {type(module).__name__} has no {'/'.join(_EPS_ATTRIBUTES)} attribute"
        )
    measured = _measure_eps(module, kind, width)
    if measured is None:
        raise AttributeError(
            f"norm module {type(module).__name__} has no {'/'.join(_EPS_ATTRIBUTES)} attribute, and "
            f"no common epsilon reproduces its output as a {kind!r} norm"
        )
    _MEASURED[module] = measured
    return measured


def _measure_eps(module: Any, kind: NormKind, width: int) -> float | None:
    import torch

    # The module's own width where it keeps one (a weightless LayerNorm still fixes it).
    weight = getattr(module, "weight", None)
    shape = getattr(module, "normalized_shape", None)
    if isinstance(weight, torch.Tensor) and weight.ndim:
        width = int(weight.shape[-1])
    elif isinstance(shape, (tuple, list)) and shape:
        width = int(shape[-1])
    parameter = next(module.parameters(), None)
    if parameter is not None and parameter.device.type == "meta":
        return None
    device = parameter.device if parameter is not None else torch.device("cpu")
    dtype = (
        parameter.dtype
        if parameter is not None and parameter.is_floating_point()
        else torch.float32
    )
    x = (
        torch.randn(1, 4, width, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        * 1e-4
    )
    x = x.to(device=device, dtype=dtype)
    bias = getattr(module, "bias", None)
    try:
        with torch.no_grad():
            want = module(x)
    except (RuntimeError, TypeError, ValueError):
        return None
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return None
    for eps in _CANDIDATE_EPS:
        with torch.no_grad():
            got = apply_norm_weight(norm_statistics(x, kind, eps)[1], weight, bias, kind, x.dtype)
        if torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-6):
            return eps
    return None
