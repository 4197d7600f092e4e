"""Hook points for layers that flatten batch and position before their MLP half (OPT).

OPT's decoder layer reshapes the residual stream to ``[batch * pos, d_model]`` before its
final norm and MLP. The canonical hooks there are ``[batch, pos, ...]``, so the driver hands
each such hook a ``FlatPoint``: it views the flat tensor as ``[batch, pos, ...]`` (the shape
the layer received, recorded per forward), fires the real HookPoint, and flattens an edited
value back. Views keep the autograd graph, so backward hooks and gradients still work.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tl_core import HookPoint

__all__ = ["FLAT_SUFFIXES", "FlatPoint", "flat_points"]

#: The per-block hooks that sit in the flattened half of an OPT layer.
FLAT_SUFFIXES = (
    "ln2.hook_in",
    "ln2.hook_scale",
    "ln2.hook_normalized",
    "ln2.hook_out",
    "mlp.hook_in",
    "mlp.hook_pre",
    "mlp.hook_pre_linear",
    "mlp.hook_post",
    "mlp.hook_out",
)


class FlatPoint(HookPoint):
    """Fires ``inner`` on ``[batch, pos, ...]`` views of ``[batch * pos, ...]`` tensors."""

    def __init__(self, inner: HookPoint, shapes: dict[int, tuple[int, ...]], layer: int) -> None:
        super().__init__(inner.name)
        self.inner = inner
        # Shared lists: has_hooks and backward checks see the real point's hooks.
        self._fwd = inner._fwd
        self._bwd = inner._bwd
        self._shapes = shapes
        self._layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fire the real hook point on ``x`` viewed with the layer's batch and position."""
        shape = self._shapes.get(self._layer)
        if shape is None or x.dim() != 2:
            return self.inner(x)  # type: ignore[no-any-return]
        seen = torch.unflatten(x, 0, shape)
        out: torch.Tensor = self.inner(seen)
        if out is seen and not self.inner.has_backward_hooks:
            return x
        return out.flatten(0, len(shape) - 1)


def flat_points(
    points: Mapping[str, HookPoint], layer: int, shapes: dict[int, tuple[int, ...]]
) -> dict[str, HookPoint]:
    """``points`` with block ``layer``'s flattened-half hooks replaced by ``FlatPoint``s."""
    out = dict(points)
    for suffix in FLAT_SUFFIXES:
        name = f"blocks.{layer}.{suffix}"
        point = points.get(name)
        if point is not None and point.has_hooks:
            out[name] = FlatPoint(point, shapes, layer)
    return out
