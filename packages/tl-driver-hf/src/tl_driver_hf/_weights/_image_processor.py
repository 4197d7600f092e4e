"""Images in the forms researchers hold (PIL images, arrays, files) as a model's pixels.

A vision-language checkpoint ships its image processor (``preprocessor_config.json``): how
to resize, crop and normalise an image for its tower. tl runs that processor, never a guess
of its own, and passes on only what it returns beside the pixels when that is nothing (a
tower that also needs image sizes or patch grids is refused by name).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from tl_core import UserError

__all__ = ["load_image_processor", "processed_pixels"]


def load_image_processor(source: str) -> tuple[Any | None, str]:
    """The checkpoint's image processor, or ``None`` with why there is none."""
    if not os.path.isdir(source):
        return None, f"{source!r} is no local folder to read an image processor from"
    if not os.path.exists(os.path.join(source, "preprocessor_config.json")):
        return None, (
            f"the checkpoint {source!r} holds no image processor (preprocessor_config.json)"
        )
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(source), ""
    except (OSError, ValueError, ImportError) as error:
        return None, f"its image processor does not load ({type(error).__name__}: {error})"


def _opened(item: Any, n: int) -> Any:
    if not isinstance(item, (str, os.PathLike)):
        return item
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(item) as image:
            return image.convert("RGB")
    except FileNotFoundError as error:
        raise UserError(
            f"image {n} of images= is the path {str(item)!r}, which does not exist"
        ) from error
    except (UnidentifiedImageError, OSError) as error:
        raise UserError(
            f"image {n} of images= is the file {str(item)!r}, which is no image PIL can read "
            f"({error})"
        ) from error


def processed_pixels(processor: Any, items: Sequence[Any]) -> torch.Tensor:
    """``[n, channels, height, width]`` pixels of ``items`` (PIL images, arrays, paths) as
    ``processor`` prepares them.

    Raises:
        UserError: A path that is no image, an image the processor refuses, or a processor
            that returns more than pixels (its tower needs them: not given by tl yet).
    """
    opened = [_opened(item, n) for n, item in enumerate(items)]
    try:
        out = processor(images=opened, return_tensors="pt")
    except (TypeError, ValueError) as error:
        kinds = ", ".join(sorted({type(i).__name__ for i in items}))
        raise UserError(
            f"the checkpoint's image processor ({type(processor).__name__}) refuses images= of "
            f"{kinds}: {error}"
        ) from error
    extra = sorted(set(out) - {"pixel_values"})
    if extra:
        raise UserError(
            f"the checkpoint's image processor ({type(processor).__name__}) also gives "
            f"{', '.join(extra)}, which its vision tower reads beside the pixels; tl passes "
            "pixels only so far"
        )
    return out["pixel_values"]  # type: ignore[no-any-return]
