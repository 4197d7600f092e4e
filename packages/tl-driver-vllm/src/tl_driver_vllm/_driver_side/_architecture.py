"""The engine-independent ``Architecture`` of a checkpoint the vllm driver serves.

Read from the layout (where its norms sit, how its block combines the sublayers) and from
tl-core's reader of the config, the one the hf driver uses too: the parity tests compare the
two drivers' descriptions of every family they both serve. Imports neither torch nor vLLM.
"""

from __future__ import annotations

from typing import Any

from tl_core import ModelInfo
from tl_core.driver_api import Architecture, QKNorm, block_form, describe_model
from tl_driver_vllm._families import Layout

__all__ = ["layout_architecture"]


def layout_architecture(config: Any, layout: Layout, info: ModelInfo) -> Architecture:
    """The description of ``config``'s checkpoint as ``layout`` serves it.

    Args:
        config: The checkpoint's ``transformers`` config (text config for wrappers).
        layout: Its settled layout (``parallel`` read from the checkpoint).
        info: The driver's ``ModelInfo`` of it.
    """
    block = block_form(
        parallel=layout.parallel,
        norm_before_attn=layout.ln1 is not None,
        norm_before_mlp=layout.ln2 is not None,
        norms_after=layout.ln1_post is not None or layout.ln2_post is not None,
    )
    qk_norm: QKNorm = (
        "none"
        if not layout.qk_norm
        else "across_heads"
        if layout.qk_norm_layout == "flat"
        else "per_head"
    )
    return describe_model(
        config,
        info,
        norm=layout.norm,
        block=block,
        qk_norm=qk_norm,
        embed_scaled=layout.embed_scaled,
        sinks=layout.attention_sinks,
    )
