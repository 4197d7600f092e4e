"""The engine-independent ``Architecture`` of a model the hf driver booted.

The adapter (hand-written or inferred) says where the norms sit and how the block combines
its sublayers; tl-core reads the config's facts (``describe_model``), so the vllm driver's
description of the same checkpoint is built from the same reader and compared with this one
in its parity tests.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tl_core import ModelInfo
from tl_core.driver_api import Architecture, QKNorm, block_form, describe_model
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["served_architecture"]

_QK_NORM: dict[str, QKNorm] = {
    "positions_first": "per_head",
    "heads_first": "per_head",
    "flat": "across_heads",
}


def served_architecture(
    model: nn.Module, adapter: ArchitectureAdapter, info: ModelInfo, *, opaque: bool, sinks: bool
) -> Architecture:
    """The description of ``model`` as ``adapter`` serves it.

    Args:
        model: The transformers ``*ForCausalLM`` model.
        adapter: Its adapter (hand-written or inferred).
        info: The driver's ``ModelInfo`` of it.
        opaque: Whether the blocks are served from outside only (an inferred architecture
            whose insides tl does not read).
        sinks: Whether attention adds a sink logit per head (``has_attention_sinks``).
    """
    config: Any = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    block = block_form(
        parallel=info.parallel_attn_mlp,
        norm_before_attn=adapter.ln1 is not None,
        norm_before_mlp=adapter.ln2 is not None,
        norms_after=info.sandwich_norm,
        opaque=opaque,
        mixer=adapter.mixer is not None,
    )
    return describe_model(
        config,
        info,
        norm=adapter.norm,
        block=block,
        qk_norm=_QK_NORM[adapter.qk_norm_layout] if info.qk_norm else "none",
        embed_scaled=adapter.embed_scaled,
        final_norm=adapter.final_norm is not None,
        sinks=sinks and not opaque,
    )
