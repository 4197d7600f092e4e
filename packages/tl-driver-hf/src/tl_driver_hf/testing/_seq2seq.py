"""Tiny encoder-decoders (T5, BART, ...) from their default configs, built offline."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
from transformers import AutoModelForSeq2SeqLM, PreTrainedModel

from tl_driver_hf._architecture._describe import widen_weights
from tl_driver_hf.testing._checkpoint import save_with_tokenizer
from tl_driver_hf.testing._default_configs import sized_config

__all__ = ["SEQ2SEQ_SIZES", "tiny_seq2seq_model", "write_seq2seq_checkpoint"]

#: Sizes set where a default config has the field. The encoder gets one block more than
#: the decoder, so a test that mixes the two stacks up shows it.
SEQ2SEQ_SIZES: Final[dict[str, int]] = {
    "vocab_size": 300,
    "d_model": 64,
    "d_kv": 16,
    "d_ff": 128,
    "num_heads": 4,
    "num_layers": 3,
    "num_decoder_layers": 2,
    "encoder_layers": 3,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 64,
}


def tiny_seq2seq_model(
    model_type: str, seed: int = 0, *, overrides: Mapping[str, Any] | None = None
) -> PreTrainedModel:
    """A tiny float32 encoder-decoder of ``model_type`` (``"t5"``, ``"bart"``, ``"marian"``,
    ...): its default config with ``SEQ2SEQ_SIZES`` and ``overrides``.

    Matrices are drawn with std ``d_model ** -0.5`` and vectors (norm weights, biases)
    jittered by 0.1, from a generator seeded with ``seed``, so every weight visibly matters.
    """
    config = sized_config(model_type, SEQ2SEQ_SIZES, overrides)
    if getattr(config, "decoder_start_token_id", None) is None:
        # T5's released checkpoints start the decoder at the padding id; its default config
        # names no start token, and transformers can then neither shift labels nor generate.
        config.decoder_start_token_id = config.pad_token_id
    torch.manual_seed(seed)
    build: Any = AutoModelForSeq2SeqLM.from_config  # untyped in transformers
    model: PreTrainedModel = build(config, dtype=torch.float32).eval()
    widen_weights(model, int(getattr(config, "d_model", 64)), seed)
    return model


def write_seq2seq_checkpoint(
    model_type: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``tiny_seq2seq_model(model_type)`` and a tiny tokenizer into the folder ``path``
    (atomically; it must not exist, or be empty).

    Returns:
        The absolute path of the written folder.
    """
    model = tiny_seq2seq_model(model_type, seed, overrides=overrides)
    vocab = int(model.config.vocab_size)
    return save_with_tokenizer(model, path, vocab_size=vocab, n_ctx=64)
