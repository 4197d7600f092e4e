"""Tiny checkpoints of every family and variant, written once per test module."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tl_driver_hf.testing import write_tiny_checkpoint

# The tests run in importlib mode; the shared module is imported by name from this folder.
sys.path.insert(0, str(Path(__file__).parent))
import _transformer_lens_peer as _shared


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``checkpoints(name)`` -> the folder of a float32 tiny checkpoint (written once).

    ``name`` is a family, one of ``_transformer_lens_peer.VARIANTS`` or of its
    ``INFERRED``, ``MASKED`` or ``VISION_LANGUAGE`` families.
    """
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made and name in _shared.VISION_LANGUAGE:
            made[name] = _shared.write_llava_checkpoint(tmp_path_factory.mktemp(name), get("llama"))
        if name not in made and name in _shared.MASKED:
            made[name] = _shared.write_masked_checkpoint(
                name, tmp_path_factory.mktemp(name), get("llama")
            )
        if name not in made and name in _shared.INFERRED:
            made[name] = _shared.write_inferred_checkpoint(
                name, tmp_path_factory.mktemp(name), get("llama")
            )
        if name not in made:
            family, overrides = _shared.VARIANTS.get(name, (name, None))
            made[name] = write_tiny_checkpoint(
                family, tmp_path_factory.mktemp(name), overrides=overrides
            )
        return made[name]

    return get
