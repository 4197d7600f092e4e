"""OPT: learned positions (offset 2), pre-LN, separate biased q/k/v, inline ReLU MLP.

OPT's attention scales the queries before calling attention, so ``hook_q``/``hook_k`` fire
at the projections (unscaled, as in HookedTransformer). Its MLP projections ``fc1``/``fc2``
sit directly in the layer, which flattens batch and position before them; the driver
restores ``[batch, pos, ...]`` for those hooks. Post-LN checkpoints (OPT-350m) and the
``project_in``/``project_out`` projections are not served.
"""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("opt"),
        embed="model.decoder.embed_tokens",
        pos_embed="model.decoder.embed_positions",
        pos_offset=2,
        layers="model.decoder.layers",
        final_norm="model.decoder.final_layer_norm",
        ln1="self_attn_layer_norm",
        ln2="final_layer_norm",
        attn="self_attn",
        o="out_proj",
        mlp="",
        mlp_inline=True,
        flat_mlp=True,
        mlp_in="fc1",
        gate=None,
        up=None,
        down="fc2",
        query_prescaled=True,
    ),
)
