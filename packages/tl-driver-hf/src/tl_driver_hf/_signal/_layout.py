"""Where a pixel or audio model's blocks are, and what they read, found by running it.

Such a model (an image classifier, a CTC speech recogniser) turns its input into a stream
of vectors (patches, audio frames) with an embedding tower of its own, then runs one list
of blocks over that stream. tl finds the list by what it does, not by name: the
``nn.ModuleList`` of the config's layer count whose blocks each run once per forward, in
order, on ``[batch, positions, width]`` tensors of one shape. Hierarchical models (Swin,
PVT), whose stages change the stream's width, and convolutional ones have no such list and
are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tl_core import ConfigError
from tl_driver_hf._runtime._torch_hooks import _input_of

__all__ = [
    "SIGNAL_KEYS",
    "SignalLayout",
    "SignalReads",
    "config_value",
    "feature_size",
    "find_blocks",
    "layer_count",
    "probe_signal",
    "run_plain",
]

#: What the model reads: images as pixels, raw audio samples, or audio feature frames
#: (a spectrogram).
SignalReads = Literal["pixels", "audio samples", "audio features"]
#: The model's keyword for each input.
SIGNAL_KEYS: dict[str, SignalReads] = {
    "pixel_values": "pixels",
    "input_values": "audio samples",
    "input_features": "audio features",
}

#: Audio samples of the probe (0.2 s at 16 kHz: a few frames after wav2vec2's 320-fold
#: downsampling), and feature frames.
_PROBE_SAMPLES = 3200
_PROBE_FRAMES = 32
_SUB_CONFIGS = ("vision_config", "audio_config", "encoder_config")
#: Config fields that hold one value per stage of a hierarchical model (Swin, PVT, ...).
_STAGED = ("depths", "hidden_sizes", "embed_dims", "num_heads")


def config_value(config: Any, *names: str) -> Any:
    """The first of ``names`` the config (or its vision/audio sub-config) sets."""
    for holder in (config, *(getattr(config, n, None) for n in _SUB_CONFIGS)):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                return value
    return None


def layer_count(config: Any) -> int | None:
    """The config's block count (``num_hidden_layers``), if it states one."""
    value = config_value(config, "num_hidden_layers", "num_layers")
    return int(value) if isinstance(value, int) else None


def probe_signal(model: nn.Module, reads: SignalReads, batch: int = 2) -> torch.Tensor:
    """A seeded random input of the config's size: pixels ``[batch, channels, size, size]``
    or audio samples ``[batch, samples]``."""
    generator = torch.Generator().manual_seed(0)
    if reads == "audio samples":
        return torch.randn(batch, _PROBE_SAMPLES, generator=generator)
    if reads == "audio features":
        return torch.randn(batch, _PROBE_FRAMES, feature_size(model.config), generator=generator)
    size = config_value(model.config, "image_size") or 224
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))
    channels = int(config_value(model.config, "num_channels") or 3)
    return torch.randn(batch, channels, height, width, generator=generator)


def feature_size(config: Any) -> int:
    """How many features an audio feature frame holds (mel bins)."""
    return int(config_value(config, "num_mel_bins", "feature_size", "input_feat_per_channel") or 80)


def run_plain(model: nn.Module, reads: SignalReads, signal: torch.Tensor) -> Any:
    """``model``'s own forward on ``signal`` (pixels, audio samples or feature frames)."""
    key = next(k for k, r in SIGNAL_KEYS.items() if r == reads)
    param = next(model.parameters())
    return model(**{key: signal.to(param.device, param.dtype)})


@dataclass(frozen=True)
class SignalLayout:
    """The block stack of a pixel or audio model.

    Attributes:
        path: The module path of the block list (``"vit.encoder.layer"``).
        blocks: Its blocks, in forward order.
        width: The stream's width (``d_model``).
        outputs: The logits' width (labels, or CTC tokens).
    """

    path: str
    blocks: tuple[nn.Module, ...]
    width: int
    outputs: int


@contextmanager
def _recording(lists: dict[str, nn.ModuleList], seen: dict[str, list[list[Any]]]) -> Iterator[None]:
    handles = []
    for path, blocks in lists.items():
        seen[path] = [[] for _ in blocks]
        for i, block in enumerate(blocks):

            def record(
                m: nn.Module, a: tuple[Any, ...], k: dict[str, Any], p: str = path, i: int = i
            ) -> None:
                try:
                    seen[p][i].append(_input_of(a, k))
                except (IndexError, KeyError):
                    seen[p][i].append(None)

            handles.append(block.register_forward_pre_hook(record, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _is_stream(calls: list[list[Any]]) -> bool:
    if any(len(c) != 1 or not isinstance(c[0], torch.Tensor) or c[0].ndim != 3 for c in calls):
        return False
    return len({tuple(c[0].shape) for c in calls}) == 1


def find_blocks(model: nn.Module, reads: SignalReads) -> SignalLayout:
    """The model's block stack, found on one forward of a probe input.

    Raises:
        ConfigError: The config states no layer count, the probe forward fails, or no
            module list of that count runs as one stack of blocks (a hierarchical or
            convolutional model).
    """
    kind = type(model).__name__
    staged = [n for n in _STAGED if isinstance(config_value(model.config, n), (list, tuple))]
    if staged:
        # One stage's block list can pass for the whole stack: refuse by the config.
        raise ConfigError(
            f"{kind} is hierarchical (its config's {staged[0]} sets one value per stage, and "
            "its stages change the stream's width): tl serves models with one stack of "
            "blocks"
        )
    n_layers = layer_count(model.config)
    if n_layers is None:
        raise ConfigError(f"{kind}'s config states no layer count (num_hidden_layers)")
    lists = {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == n_layers
    }
    seen: dict[str, list[list[Any]]] = {}
    try:
        with _recording(lists, seen), torch.no_grad():
            logits = run_plain(model, reads, probe_signal(model, reads)).logits
    except Exception as error:  # the model's own forward: any failure means tl cannot run it
        raise ConfigError(
            f"{kind} does not run on {reads} of its config's size: {type(error).__name__}: {error}"
        ) from error
    for path, calls in seen.items():
        if _is_stream(calls):
            width, outputs = int(calls[0][0].shape[-1]), int(logits.shape[-1])
            return SignalLayout(path, tuple(lists[path]), width, outputs)
    raise ConfigError(
        f"tl found no stack of blocks in {kind}: no list of {n_layers} modules (the config's "
        "layer count) runs once per forward on [batch, positions, width] tensors of one "
        "shape (hierarchical models such as Swin or PVT change the width between stages; "
        "convolutional ones have no positions); tl serves models with one stack of blocks"
    )
