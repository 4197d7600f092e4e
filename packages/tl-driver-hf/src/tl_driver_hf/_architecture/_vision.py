"""How a vision-language model's images reach its language stack, read from the booted model.

The config names the vision tower (``vision_config``: its model type, image size, channels)
and the image token; transformers' ``get_image_features`` runs the tower and the projector.
How many positions one image fills is measured, by running it on one blank image: counts
follow rules of each family (patches, a class token kept or dropped, pooling, tiles) that
no config field states alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tl_core.architecture import UNKNOWN, VisionDescription

__all__ = ["image_features", "read_vision"]


def _first(config: Any, *names: str) -> Any:
    for holder in (config, getattr(config, "vision_config", None)):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                return value
    return None


def image_features(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The projected features ``get_image_features`` gives for ``pixels``, as one
    ``[positions, d_model]`` tensor in the order they fill the image tokens."""
    with torch.no_grad():
        features: Any = model.get_image_features(pixel_values=pixels)  # type: ignore[operator]
    for name in ("pooler_output", "last_hidden_state"):
        value = getattr(features, name, None)
        if value is not None:
            features = value
            break
    if isinstance(features, (list, tuple)):
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])  # type: ignore[no-any-return]


def read_vision(
    model: nn.Module, config: Any, *, measure: bool
) -> tuple[VisionDescription | None, str]:
    """The model's ``VisionDescription``, or ``None`` with why it takes no images from tl.

    Args:
        model: The booted transformers model.
        config: Its config.
        measure: Whether to run the tower once to count an image's positions (``False``
            for a model without weights: the count is then ``"unknown"``).
    """
    vision = getattr(config, "vision_config", None)
    token = _first(config, "image_token_id", "image_token_index")
    if vision is None or not isinstance(token, int) or isinstance(token, bool):
        return None, "the config names no vision tower and image token"
    if not callable(getattr(model, "get_image_features", None)):
        return None, f"{type(model).__name__} has no get_image_features"
    size = _first(config, "image_size")
    if isinstance(size, int):
        height, width = size, size
    elif isinstance(size, (list, tuple)) and len(size) == 2:
        height, width = int(size[0]), int(size[1])
    else:
        return None, "the vision config states no image size (its processor chooses one)"
    channels = int(_first(config, "num_channels") or 3)
    tower = str(getattr(vision, "model_type", None) or type(vision).__name__)
    count: int | Any = UNKNOWN
    if measure:
        param = next(model.parameters())
        blank = torch.zeros(1, channels, height, width, dtype=param.dtype, device=param.device)
        try:
            count = int(image_features(model, blank).shape[0])
        except Exception as error:  # the tower needs inputs tl does not give (sizes, grids)
            return None, (
                f"its vision tower does not run on pixels alone ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:160] if str(error) else ''})"
            )
    described = VisionDescription(tower, (height, width), channels, token, count)
    return described, ""
