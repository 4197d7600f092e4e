"""Tiny models of any transformers model type, from its default config.

``write_tiny_checkpoint`` builds the families tl describes, each from a hand-written
table; a type no table covers (the architectures the hf driver infers) gets its default
config shrunk by field name instead. Weights are drawn wider than transformers'
initialisation (std 0.02 leaves attention near uniform and logits near 0), so a wrong
tensor shows in a comparison.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from transformers import AutoConfig, PreTrainedModel

from tl_driver_hf._architecture._describe import SHRUNK_SIZES, shrunk_model
from tl_driver_hf.testing._checkpoint import save_with_tokenizer

__all__ = [
    "TINY_SIZES",
    "VLLM_TINY_SIZES",
    "sized_config",
    "tiny_default_model",
    "write_tiny_default_checkpoint",
]

#: The sizes set on a default config, where it has the field (others stay as they are).
TINY_SIZES: Final[dict[str, int]] = SHRUNK_SIZES
#: ``TINY_SIZES`` with heads of 32 (the smallest head size vLLM's CPU attention runs).
VLLM_TINY_SIZES: Final[dict[str, int]] = {
    **SHRUNK_SIZES, "hidden_size": 128, "head_dim": 32, "intermediate_size": 256,
}  # fmt: skip


def sized_config(
    model_type: str, sizes: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
) -> Any:
    """``model_type``'s default config with the ``sizes`` it has fields for and every
    override, through its constructor (configs derive fields there: T5's
    ``feed_forward_proj`` sets ``is_gated_act``); special token ids past the vocabulary are
    moved to 0."""
    default = AutoConfig.for_model(model_type)
    kept = {k: v for k, v in sizes.items() if hasattr(default, k)}
    config = AutoConfig.for_model(model_type, **{**kept, **(overrides or {})})
    vocab = getattr(config, "vocab_size", None)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        token_id = getattr(config, key, None)
        if isinstance(vocab, int) and isinstance(token_id, int) and token_id >= vocab:
            setattr(config, key, 0)
    return config


def tiny_default_model(
    model_type: str, seed: int = 0, *, sizes: Mapping[str, int] | None = None
) -> PreTrainedModel:
    """A tiny float32 causal LM of ``model_type``: its default config with ``TINY_SIZES``.

    Special token ids past the tiny vocabulary are dropped and per-layer ``layer_types``
    cut to the layer count. Matrices are drawn with std ``hidden_size ** -0.5`` and vectors
    (norm weights, biases) jittered by 0.1, from a generator seeded with ``seed``.

    Args:
        model_type: A ``transformers`` model type (``"granite"``).
        seed: The weights' seed.
        sizes: Other sizes to set instead of ``TINY_SIZES`` (vLLM's CPU attention needs a
            head size of 32 or more: ``{**TINY_SIZES, "hidden_size": 128, "head_dim": 32}``).

    Returns:
        The model, in eval mode.
    """
    config: Any = AutoConfig.for_model(model_type)
    return shrunk_model(config, sizes=dict(sizes) if sizes is not None else TINY_SIZES, seed=seed)


def write_tiny_default_checkpoint(
    model_type: str,
    path: str | os.PathLike[str],
    *,
    sizes: Mapping[str, int] | None = None,
    seed: int = 0,
) -> Path:
    """Write ``tiny_default_model(model_type)`` with a tiny tokenizer into the folder ``path``
    (loadable offline by transformers and vLLM; written atomically).

    Args:
        model_type: A ``transformers`` model type (``"phi"``).
        path: The folder to create; it must not exist, or be an empty folder.
        sizes: The sizes (default ``TINY_SIZES``; ``VLLM_TINY_SIZES`` for vLLM's CPU build).
        seed: The weights' seed.

    Returns:
        The absolute path of the written folder.
    """
    model = tiny_default_model(model_type, seed, sizes=sizes)
    vocab = int(model.config.vocab_size)
    n_ctx = int(getattr(model.config, "max_position_embeddings", 0) or 256)
    return save_with_tokenizer(model, path, vocab_size=vocab, n_ctx=min(n_ctx, 4096))
