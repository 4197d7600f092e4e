"""Tiny image classifiers and CTC speech recognisers (ViT, DeiT, wav2vec2, HuBERT, ...)
from their default configs, built offline."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
import transformers
from transformers import PreTrainedModel
from transformers.models.auto import modeling_auto

from tl_driver_hf._architecture._describe import widen_weights
from tl_driver_hf.testing._checkpoint import save_with_tokenizer
from tl_driver_hf.testing._default_configs import sized_config

__all__ = ["SIGNAL_SIZES", "tiny_signal_model", "write_signal_checkpoint"]

#: Sizes set where a default config has the field: 2 blocks of width 64 over 32x32 images
#: in 8x8 patches (16 patches and a class token), or over a few audio frames.
SIGNAL_SIZES: Final[dict[str, int]] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "image_size": 32,
    "patch_size": 8,
    "vocab_size": 32,
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
}

_MAPPINGS = (
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    ("MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
)


def _class_of(model_type: str) -> tuple[str, str]:
    for mapping, auto in _MAPPINGS:
        names = getattr(modeling_auto, mapping).get(model_type)
        if names is not None:
            return (names if isinstance(names, str) else names[0]), auto
    raise KeyError(
        f"{model_type!r} is neither an image classifier nor a CTC speech recogniser in transformers"
    )


def tiny_signal_model(
    model_type: str, seed: int = 0, *, overrides: Mapping[str, Any] | None = None
) -> PreTrainedModel:
    """A tiny float32 image classifier or CTC model of ``model_type`` (``"vit"``,
    ``"deit"``, ``"wav2vec2"``, ``"hubert"``, ...): its default config with
    ``SIGNAL_SIZES`` and ``overrides``, weights as ``tiny_seq2seq_model`` draws them.

    Raises:
        KeyError: transformers maps ``model_type`` to neither kind.
    """
    class_name, auto = _class_of(model_type)
    config = sized_config(model_type, SIGNAL_SIZES, overrides)
    # Classes that share a model type (DeiT's with and without a teacher) need the name.
    config.architectures = [class_name]
    torch.manual_seed(seed)
    build: Any = getattr(transformers, auto).from_config  # untyped in transformers
    model: PreTrainedModel = build(config, dtype=torch.float32).eval()
    widen_weights(model, int(getattr(config, "hidden_size", 64)), seed)
    return model


def write_signal_checkpoint(
    model_type: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``tiny_signal_model(model_type)`` into the folder ``path`` (atomically; it
    must not exist, or be empty). No tokenizer: the model reads pixels or audio.

    Returns:
        The absolute path of the written folder.
    """
    model = tiny_signal_model(model_type, seed, overrides=overrides)
    return save_with_tokenizer(model, path, vocab_size=None, n_ctx=0)
