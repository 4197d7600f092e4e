"""Images for vision-language models: widening lone image tokens, and checking pixels.

The hf driver's tests run real LLaVA checkpoints against transformers; these pin the
engine-independent rules on any prompt: how many positions an image fills, where the runs
are, and that every mismatch is refused before the engine runs.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tl_core import InterventionSpec, SpecError, UnsupportedFeatureError, UserError, parse_spec
from tl_core.architecture import VisionDescription
from tl_core.driver_api import (
    TokenBatch,
    checked_images,
    image_positions,
    pad_batch,
    with_image_tokens,
)

_TOKEN = 9
_VISION = VisionDescription("clip_vision_model", (4, 4), 3, _TOKEN, 5)


def _driver(vision: VisionDescription | None = _VISION, images: bool = True) -> Any:
    return SimpleNamespace(
        name="fake",
        supports=lambda feature: images and feature == "images",
        architecture=SimpleNamespace(name="Fake", vision=vision),
    )


def _batch(rows: list[list[int]]) -> TokenBatch:
    return pad_batch(rows, pad_id=0)


# Prompts of text ids (1..8) with lone image tokens between them.
_prompts = st.lists(
    st.lists(st.one_of(st.integers(1, 8), st.just(_TOKEN)), min_size=1, max_size=12).filter(
        lambda row: all(not (a == b == _TOKEN) for a, b in itertools.pairwise(row))
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=60, deadline=None)
@given(_prompts)
def test_each_lone_image_token_becomes_one_images_run_and_text_stays(rows: list[list[int]]) -> None:
    widened = with_image_tokens(_batch(rows), _VISION, pad_id=0)
    for row, out in zip(rows, widened.rows(), strict=True):
        assert [t for t in out if t != _TOKEN] == [t for t in row if t != _TOKEN]
        assert out.count(_TOKEN) == 5 * row.count(_TOKEN)
    # Widening is done once: a widened batch is taken as it is.
    again = with_image_tokens(widened, _VISION, pad_id=0)
    assert again.rows() == widened.rows()
    n_images = sum(row.count(_TOKEN) for row in rows)
    pixels = torch.rand(n_images, 3, 4, 4)
    if n_images:
        assert checked_images(_driver(), pixels, widened).shape == (n_images, 3, 4, 4)
    with pytest.raises(UserError, match="give one image per image token"):
        checked_images(_driver(), torch.rand(n_images + 1, 3, 4, 4), widened)


def test_images_in_a_list_are_stacked_in_order() -> None:
    batch = _batch([[1, *[_TOKEN] * 5, 2, *[_TOKEN] * 5]])
    first, second = torch.rand(3, 4, 4), torch.rand(3, 4, 4)
    stacked = checked_images(_driver(), [first, second], batch)
    assert torch.equal(stacked, torch.stack([first, second]))


@pytest.mark.parametrize(
    ("rows", "pixels", "error", "message"),
    [
        ([[1, *[_TOKEN] * 3]], torch.rand(1, 3, 4, 4), UserError, "a run of 3 image tokens"),
        ([[1, *[_TOKEN] * 5]], torch.rand(1, 1, 4, 4), UserError, r"takes \(3, 4, 4\)"),
        ([[1, *[_TOKEN] * 5]], torch.ones(1, 3, 4, 4, dtype=torch.int64), UserError, "float"),
        ([[1, *[_TOKEN] * 5]], "cat.png", UserError, "takes images as pixel tensors"),
        ([[1, *[_TOKEN] * 5]], [], UserError, "empty list"),
        ([[1, 2]], torch.rand(1, 3, 4, 4), UserError, "tokens of 0 images"),
    ],
)
def test_bad_images_are_named(
    rows: list[list[int]], pixels: Any, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        checked_images(_driver(), pixels, _batch(rows))


def test_a_model_that_reads_no_images_refuses_them() -> None:
    batch = _batch([[1, 2]])
    with pytest.raises(UnsupportedFeatureError, match="takes no images for Fake"):
        checked_images(_driver(vision=None), torch.rand(1, 3, 4, 4), batch)
    with pytest.raises(UnsupportedFeatureError, match="takes no images"):
        checked_images(_driver(images=False), torch.rand(1, 3, 4, 4), batch)
    unmeasured = VisionDescription("clip_vision_model", (4, 4), 3, _TOKEN, "unknown")
    with pytest.raises(UnsupportedFeatureError, match="booted without weights"):
        checked_images(_driver(vision=unmeasured), torch.rand(1, 3, 4, 4), batch)


def test_a_spec_names_the_image_positions_and_round_trips() -> None:
    spec = parse_spec({"op": "add", "value": [1.0, 2.0], "pos": "image"}, hook="blocks.0.hook_in")
    assert spec.pos == "image"
    assert parse_spec(spec.to_dict(), hook="blocks.0.hook_in") == spec
    assert InterventionSpec.suppress(pos="image").pos == "image"
    with pytest.raises(SpecError, match="the one named position is 'image'"):
        parse_spec({"op": "suppress", "pos": "images"}, hook="blocks.0.hook_in")
    with pytest.raises(SpecError, match="lists no positions until the prompt is known"):
        parse_spec({"op": "add", "value": [[1.0], [2.0]], "pos": "image"}, hook="h")
    widened = with_image_tokens(_batch([[1, _TOKEN, 2], [3, 4]]), _VISION, pad_id=0)
    assert image_positions(_VISION, widened) == ((1, 2, 3, 4, 5), ())
