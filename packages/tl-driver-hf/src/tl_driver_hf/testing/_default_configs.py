"""Tiny models of any transformers model type, from its default config.

``write_tiny_checkpoint`` builds the families tl describes, each from a hand-written
table; a type no table covers (the architectures the hf driver infers) gets its default
config shrunk by field name instead. Weights are drawn wider than transformers'
initialisation (std 0.02 leaves attention near uniform and logits near 0), so a wrong
tensor shows in a comparison.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

__all__ = ["TINY_SIZES", "tiny_default_model"]

#: The sizes set on a default config, where it has the field (others stay as they are).
TINY_SIZES: Final[dict[str, int]] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "head_dim": 16,
    "vocab_size": 512,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "state_size": 8,
    "time_step_rank": 8,
}


def tiny_default_model(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A tiny float32 causal LM of ``model_type``: its default config with ``TINY_SIZES``.

    Special token ids past the tiny vocabulary are dropped and per-layer ``layer_types``
    cut to the layer count. Matrices are drawn with std ``hidden_size ** -0.5`` and vectors
    (norm weights, biases) jittered by 0.1, from a generator seeded with ``seed``.

    Args:
        model_type: A ``transformers`` model type (``"granite"``).
        seed: The weights' seed.

    Returns:
        The model, in eval mode.
    """
    config: Any = AutoConfig.for_model(model_type)
    for key, value in TINY_SIZES.items():
        if hasattr(config, key):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, value)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= TINY_SIZES["vocab_size"]:
            setattr(config, key, None)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.layer_types = layer_types[: TINY_SIZES["num_hidden_layers"]]
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    build: Any = AutoModelForCausalLM.from_config  # untyped in transformers
    model: PreTrainedModel = build(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if param.dim() >= 2:
                param.copy_(noise * TINY_SIZES["hidden_size"] ** -0.5)
            else:
                param.add_(noise * 0.1)
    return model
