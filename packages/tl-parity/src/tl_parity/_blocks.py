"""Which blocks ``layers`` names: checked against the model's block count, negatives from the end.

The parent process reads the block count without booting where it can (an hf-style
folder's ``config.json``, a native preset and its options) and refuses a bad ``layers``
before any driver process starts; the worker checks again against the booted model, so a
count that only booting reveals (a hub id, a GGUF file) is checked too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tl_core import UserError

__all__ = ["LayerRangeError", "declared_blocks", "layers_text", "resolve_layers"]


class LayerRangeError(UserError):
    """``layers`` names a block the model does not have, or selects no block hook at all."""


def layers_text(layers: Sequence[int]) -> str:
    """The selection as the command line spells it, e.g. ``"0,-1"``."""
    return ",".join(str(i) for i in layers)


def resolve_layers(layers: Sequence[int], n_blocks: int, model: str) -> list[int]:
    """Block indices in ``0..n_blocks-1``, sorted and deduplicated; ``-1`` is the last block.

    Args:
        layers: The requested indices (negative ones count from the end).
        n_blocks: How many blocks the model has.
        model: The model's name, for the message.

    Raises:
        LayerRangeError: An index outside ``-n_blocks..n_blocks-1``.
    """
    bad = [i for i in layers if not -n_blocks <= i < n_blocks]
    if bad:
        noun = "block" if len(bad) == 1 else "blocks"
        raise LayerRangeError(
            f"layers {layers_text(layers)!r} asks for {noun} {layers_text(bad)}, but {model!r} has {n_blocks} blocks "
            f"({_valid(n_blocks)}); choose among those or use 'all'"
        )
    return sorted({i + n_blocks if i < 0 else i for i in layers})


def _valid(n_blocks: int) -> str:
    return f"0..{n_blocks - 1}, or -{n_blocks}..-1 counted from the end"


def declared_blocks(model: str, driver: str, options: Mapping[str, Any]) -> int | None:
    """The block count of ``model`` as ``driver`` will boot it, when known without booting.

    Args:
        model: A checkpoint folder, hub id or (native) preset.
        driver: The driver that boots it.
        options: The driver's boot options (the native driver takes config fields there).

    Returns:
        The count from a native preset and its options, or from the ``config.json`` of a
        checkpoint folder (the text config of a multimodal wrapper); ``None`` otherwise.
    """
    if driver == "native":
        return _native_blocks(model, options)
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the driver reports an unreadable config when it boots
    return _config_blocks(data) if isinstance(data, dict) else None


def _native_blocks(model: str, options: Mapping[str, Any]) -> int | None:
    from tl_core.native import NativeConfig

    fields = {k: v for k, v in options.items() if k not in ("device", "dtype")}
    try:
        return NativeConfig.preset(model, **fields).n_layers
    except (UserError, TypeError):
        return None  # a bad option is the booting driver's error to report


def _config_blocks(data: Mapping[str, Any]) -> int | None:
    from tl_core.architecture import model_info_from_config

    for config in (data, data.get("text_config")):
        if not isinstance(config, Mapping):
            continue
        try:
            info = model_info_from_config(
                SimpleNamespace(**config),
                normalization_type=None,
                positional_embedding_type="none",
                gated_mlp=False,
            )
        except (UserError, AttributeError, TypeError, ValueError):
            continue  # not this level's sizes (a multimodal wrapper keeps them in text_config)
        return info.n_layers
    return None
