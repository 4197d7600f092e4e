"""Which parameter an MLP factor belongs to, recognised by what it computes.

Among a block's parameters shaped ``(d_model, d_mlp)`` or ``(d_mlp, d_model)``, the one
(and the orientation) that maps the hooked input to the hooked output up to a constant bias
at the sampled real positions: ``Conv1D`` (``[in, out]``), ``nn.Linear`` (``[out, in]``) and
the native model are told apart from the numbers, not from the model's class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tl_core._errors import UnsupportedFeatureError, UserError

__all__ = ["WeightSite", "candidates_of", "module_of", "recognise", "wide"]

Which = Literal["in", "out"]

#: Real positions used to recognise a weight (a few are plenty; the check is a matmul).
_CHECK_POSITIONS = 32
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class WeightSite:
    """Where one MLP weight lives in the model and how it is laid out.

    Attributes:
        name: The parameter's name in ``bridge.driver.module.named_parameters()``.
        shape: The parameter's shape.
        transposed: ``False`` when the parameter is ``[in, out]`` (``y = x @ W``: native
            model, GPT-2's ``Conv1D``), ``True`` when it is ``[out, in]`` (``nn.Linear``).
        fit_error: How far the recognised map is from the hooked values: the largest
            deviation from a constant bias, relative to the spread of the output.
    """

    name: str
    shape: tuple[int, ...]
    transposed: bool
    fit_error: float


def module_of(model: Any) -> nn.Module:
    module = getattr(model.driver, "module", None)
    if isinstance(module, nn.Module):
        return module
    if isinstance(model, nn.Module):
        return model
    raise UnsupportedFeatureError(
        f"backward_lens reads the MLP weights from the model's parameters, and driver "
        f"{getattr(model.driver, 'name', '?')!r} exposes no nn.Module"
    )


def candidates_of(module: nn.Module, model: Any, layer: int) -> list[tuple[str, nn.Parameter]]:
    """Parameters of block ``layer`` shaped like an MLP projection, either orientation.

    A parameter belongs to the block whose index is the first number in its dotted name
    (``blocks.3.mlp.W_in``, ``hf_model.transformer.h.3.mlp.c_fc.weight``); in a model whose
    names hold no numbers every such parameter is a candidate of every block.
    """
    info = model.cfg
    shapes = {(info.d_model, info.d_mlp), (info.d_mlp, info.d_model)}
    shaped = [(n, p) for n, p in module.named_parameters() if tuple(p.shape) in shapes]
    numbered = [(n, p, _LAYER_INDEX.search(n)) for n, p in shaped]
    if any(m is not None for _, _, m in numbered):
        found = [(n, p) for n, p, m in numbered if m is not None and int(m.group(1)) == layer]
    else:
        found = shaped
    if not found:
        raise UnsupportedFeatureError(
            f"backward_lens found no parameter of shape ({info.d_model}, {info.d_mlp}) or "
            f"({info.d_mlp}, {info.d_model}) for block {layer} in {type(module).__name__} "
            f"({len(shaped)} such parameters in the whole model), so it cannot tell which "
            f"weight the gradient belongs to; nothing was run"
        )
    return found


def recognise(
    candidates: list[tuple[str, nn.Parameter]],
    inputs: torch.Tensor,
    outputs: torch.Tensor,
    layer: int,
    which: Which,
) -> WeightSite:
    """The one parameter (and orientation) mapping ``inputs`` to ``outputs`` plus a bias."""
    inputs, outputs = inputs[:_CHECK_POSITIONS], outputs[:_CHECK_POSITIONS]
    d_in, d_out = inputs.shape[-1], outputs.shape[-1]
    tol = 1e-3 if inputs.dtype in (torch.float32, torch.float64) else 5e-2
    spread = float((outputs - outputs.mean(dim=0)).abs().max()) if len(outputs) > 1 else 0.0
    fits: list[WeightSite] = []
    tried: list[str] = []
    for name, param in candidates:
        for transposed in (False, True):
            if tuple(param.shape) != ((d_out, d_in) if transposed else (d_in, d_out)):
                continue
            weight = param.detach()
            w = (weight.T if transposed else weight).to(
                device=inputs.device, dtype=wide(inputs).dtype
            )
            residual = wide(outputs) - wide(inputs) @ w
            error = (
                float((residual - residual.mean(dim=0)).abs().max()) / spread
                if spread
                else float("nan")
            )
            tried.append(f"{name} {'[out, in]' if transposed else '[in, out]'}: {error:.2g}")
            if error <= tol:
                fits.append(WeightSite(name, tuple(param.shape), transposed, error))
    if len(fits) == 1:
        return fits[0]
    pair = ("mlp.hook_in", "mlp.hook_pre") if which == "in" else ("mlp.hook_post", "mlp.hook_out")
    where = f"blocks.{layer}.{pair[0]} -> blocks.{layer}.{pair[1]}"
    if not spread:
        raise UserError(
            f"backward_lens cannot tell which weight computes {where}: the {len(outputs)} real "
            f"position(s) give the same value; pass a longer or more varied input"
        )
    if fits:
        raise UnsupportedFeatureError(
            f"backward_lens: several weights compute {where} equally well "
            f"({', '.join(f.name for f in fits)}), so the layout of W_{which} is ambiguous"
        )
    raise UnsupportedFeatureError(
        f"backward_lens: no weight of block {layer} maps {where} up to a bias (relative "
        f"error per candidate: {'; '.join(tried)}; {tol:g} needed). The hooks are not the "
        f"real input and output of one projection here (a norm, scale or dropout between "
        f"them?), so the rank-one factors would not sum to the weight's gradient"
    )


def wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 or wider (half-precision sums lose the small terms)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()
