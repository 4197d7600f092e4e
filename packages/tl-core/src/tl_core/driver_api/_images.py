"""Images for a vision-language model: pixels checked against the prompts' image tokens.

A vision-language model reads each image as ``tokens_per_image`` consecutive positions of
the image token (``tl_core.architecture.VisionDescription``): its projected features replace
the embeddings there. Images come in the order their image tokens appear, prompt by prompt.
A prompt may write the image token once per image; ``with_image_tokens`` widens each lone
one to the image's run, as the model's processor does.
"""

from __future__ import annotations

from typing import Any

import torch

from tl_core._errors import UnsupportedFeatureError, UserError
from tl_core.architecture._description import VisionDescription
from tl_core.architecture._vocabulary import UNKNOWN
from tl_core.driver_api._batching import TokenBatch, pad_batch

__all__ = ["ImageInput", "checked_images", "image_positions", "vision_of", "with_image_tokens"]

#: What ``images=`` takes: a ``[n, channels, height, width]`` tensor, one image
#: ``[channels, height, width]``, a sequence of such images, or images in another form the
#: driver reads with the checkpoint's image processor (PIL images, arrays, file paths), one
#: or a sequence.
ImageInput = Any


def vision_of(driver: Any) -> VisionDescription:
    """How ``driver``'s model reads images.

    Raises:
        UnsupportedFeatureError: The driver (or its model) takes no images, or tl did not
            measure how many positions an image fills.
    """
    described = getattr(driver, "architecture", None)
    vision = getattr(described, "vision", None)
    if not driver.supports("images") or not isinstance(vision, VisionDescription):
        name = getattr(described, "name", None) or "this model"
        why = getattr(driver, "images_refused", None)
        because = f" ({why})" if isinstance(why, str) and why else ""
        raise UnsupportedFeatureError(
            f"driver {driver.name!r} takes no images for {name}{because}: images reach "
            "vision-language models booted on the hf driver; drop images="
        )
    if vision.tokens_per_image == UNKNOWN:
        raise UnsupportedFeatureError(
            f"tl did not measure how many positions an image fills in {vision.tower} (it "
            "was booted without weights); boot it with its weights to give it images"
        )
    return vision


def with_image_tokens(batch: TokenBatch, vision: VisionDescription, pad_id: int) -> TokenBatch:
    """``batch`` with each lone image token widened to the ``tokens_per_image`` of one image.

    Runs of the image token of another length are left as they are (``checked_images``
    names them). A batch without a lone image token is returned unchanged.
    """
    per_image = vision.tokens_per_image
    assert isinstance(per_image, int)
    token = vision.image_token_id
    rows = batch.rows()
    widened: list[list[int]] = []
    for row in rows:
        out: list[int] = []
        for i, t in enumerate(row):
            lone = (
                t == token
                and (i == 0 or row[i - 1] != token)
                and (i + 1 == len(row) or row[i + 1] != token)
            )
            out.extend([token] * per_image if lone else [t])
        widened.append(out)
    if widened == rows:
        return batch
    return pad_batch(widened, pad_id=pad_id)


def image_positions(vision: VisionDescription, batch: TokenBatch) -> tuple[tuple[int, ...], ...]:
    """Each prompt's image positions (in the prompt, from 0): what ``"pos": "image"`` edits."""
    token = vision.image_token_id
    return tuple(tuple(i for i, t in enumerate(row) if t == token) for row in batch.rows())


def _pixels(driver: Any, value: object) -> torch.Tensor:
    """Pixel tensors as they are; images in another form (PIL images, arrays, file paths)
    through the driver's ``pixel_values`` (the checkpoint's own image processor)."""
    if isinstance(value, torch.Tensor):
        return value[None] if value.ndim == 3 else value
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise UserError(
            "images= is an empty list; give one image per image token of the prompts, or "
            "leave images= out for text alone"
        )
    if all(isinstance(item, torch.Tensor) for item in items):
        tensors: list[torch.Tensor] = []
        for n, image in enumerate(items):
            assert isinstance(image, torch.Tensor)
            if image.ndim not in (3, 4):
                raise UserError(
                    f"image {n} of images= is {tuple(image.shape)}; give each image as a "
                    "[channels, height, width] tensor of pixel values (the model's processor "
                    "normalises them)"
                )
            tensors.append(image if image.ndim == 4 else image[None])
        return torch.cat(tensors)
    prepare = getattr(driver, "pixel_values", None)
    if not callable(prepare):
        kinds = sorted({type(item).__name__ for item in items})
        raise UserError(
            f"images= holds {', '.join(kinds)}; driver {driver.name!r} takes images as pixel "
            "tensors [n, channels, height, width] only"
        )
    pixels = prepare(items)
    assert isinstance(pixels, torch.Tensor)
    return pixels


def checked_images(driver: Any, value: object, batch: TokenBatch) -> torch.Tensor:
    """``images=`` as one ``[n, channels, height, width]`` float tensor on the CPU, checked
    against the model and against the image tokens of ``batch``.

    Images that are not tensors go through the driver's ``pixel_values`` (the hf driver
    runs the checkpoint's own image processor on PIL images, arrays and file paths).

    Raises:
        UnsupportedFeatureError: The driver or its model takes no images.
        UserError: Images the driver cannot read, a size or channel count the tower does not
            take, or
            image tokens that do not fill exactly one run of ``tokens_per_image`` per image
            (the prompt at fault named), all before the engine runs.
    """
    vision = vision_of(driver)
    pixels = _pixels(driver, value)
    if pixels.ndim != 4:
        raise UserError(
            f"images= has shape {tuple(pixels.shape)}; give [n, channels, height, width] pixels"
        )
    if not pixels.dtype.is_floating_point:
        raise UserError(f"images must hold float pixel values, got dtype {pixels.dtype}")
    expected = (vision.channels, *vision.image_size)
    if tuple(pixels.shape[1:]) != expected:
        raise UserError(
            f"images are {tuple(pixels.shape[1:])} (channels, height, width); the "
            f"{vision.tower} tower takes {expected}: resize them (the model's image processor "
            "does) before passing them"
        )
    if not bool(torch.isfinite(pixels).all()):
        raise UserError("images hold NaN or infinite pixel values")
    per_image = vision.tokens_per_image
    assert isinstance(per_image, int)
    token = vision.image_token_id
    runs_per_prompt = [_runs(row, token) for row in batch.rows()]
    counts = [sum(runs) for runs in runs_per_prompt]
    for b, runs in enumerate(runs_per_prompt):
        odd = [r for r in runs if r % per_image]
        if odd:
            raise UserError(
                f"prompt {b} holds a run of {odd[0]} image tokens (id {token}); each image "
                f"fills {per_image} positions: write the image token once per image (tl "
                f"widens it) or {per_image} times in a row per image"
            )
    images = sum(counts) // per_image
    if images != pixels.shape[0]:
        where = ", ".join(f"prompt {b}: {n // per_image}" for b, n in enumerate(counts))
        raise UserError(
            f"the prompts hold the tokens of {_count(images, 'image')} ({where}) and images= "
            f"gives {_count(int(pixels.shape[0]), 'image')}: give one image per image token, "
            "in prompt order"
        )
    return pixels.detach().to("cpu")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _runs(row: list[int], token: int) -> list[int]:
    runs: list[int] = []
    previous = None
    for t in row:
        if t == token:
            if previous == token:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = t
    return runs
