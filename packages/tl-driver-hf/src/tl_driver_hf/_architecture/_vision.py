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

__all__ = ["image_features", "model_pixels", "read_vision"]


def _first(config: Any, *names: str) -> Any:
    for holder in (config, getattr(config, "vision_config", None)):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                return value
    return None


def model_pixels(pixels: torch.Tensor, grouped: bool) -> torch.Tensor:
    """tl's ``[n, channels, height, width]`` images as the model's ``pixel_values``: as they
    are, or ``grouped`` as one list of images ``[1, n, channels, height, width]`` (Idefics2
    and 3, SmolVLM: their image tokens take the images in order, whichever prompt holds
    them)."""
    return pixels[None] if grouped else pixels


def image_features(
    model: nn.Module, pixels: torch.Tensor, *, grouped: bool = False
) -> torch.Tensor:
    """The projected features ``get_image_features`` gives for ``pixels``
    (``[n, channels, height, width]``; see ``model_pixels`` for ``grouped``), as one
    ``[positions, d_model]`` tensor in the order they fill the image tokens."""
    with torch.no_grad():
        features: Any = model.get_image_features(pixel_values=model_pixels(pixels, grouped))  # type: ignore[operator]
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
) -> tuple[VisionDescription | None, str, bool]:
    """The model's ``VisionDescription``, or ``None`` with why it takes no images from tl;
    and whether it takes its pixels grouped (``model_pixels``).

    Args:
        model: The booted transformers model.
        config: Its config.
        measure: Whether to run the tower once to count an image's positions (``False``
            for a model without weights: the count is then ``"unknown"``).
    """
    vision = getattr(config, "vision_config", None)
    token = _first(config, "image_token_id", "image_token_index")
    if vision is None or not isinstance(token, int) or isinstance(token, bool):
        return None, "the config names no vision tower and image token", False
    if not callable(getattr(model, "get_image_features", None)):
        return None, f"{type(model).__name__} has no get_image_features", False
    size = _first(config, "image_size")
    if isinstance(size, int):
        height, width = size, size
    elif isinstance(size, (list, tuple)) and len(size) == 2:
        height, width = int(size[0]), int(size[1])
    else:
        return None, "the vision config states no image size (its processor chooses one)", False
    channels = int(_first(config, "num_channels") or 3)
    tower = str(getattr(vision, "model_type", None) or type(vision).__name__)
    count: int | Any = UNKNOWN
    grouped = False
    if measure:
        param = next(model.parameters())
        # Not zeros: Idefics drops all-zero images as the padding of a prompt's image list.
        probe = torch.full(
            (1, channels, height, width), 0.5, dtype=param.dtype, device=param.device
        )
        try:
            count = int(image_features(model, probe).shape[0])
        except Exception as error:  # the tower needs inputs tl does not give (sizes, grids)
            try:
                count, grouped = int(image_features(model, probe, grouped=True).shape[0]), True
            except Exception:  # report the plain form's failure: it is the usual one
                return (
                    None,
                    (
                        f"its vision tower does not run on pixels alone ({type(error).__name__}: "
                        f"{str(error).splitlines()[0][:160] if str(error) else ''})"
                    ),
                    False,
                )
    described = VisionDescription(tower, (height, width), channels, token, count)
    return described, "", grouped
