"""GPT-J: separate q/k/v, partial "rotate every two" rotary, parallel block with one norm.

GPT-J's block normalises its input once (``ln_1``) and feeds that one tensor to both
attention and the MLP. There is no second norm module, so the driver serves it as ``ln1.*``
only and declares ``ln2.hook_scale``/``hook_normalized``/``hook_out`` non-fireable with the
reason (serving the same tensor under two names would let an ``ln2`` edit change attention
too). ``mlp.hook_in`` is the MLP's input, which equals ``ln1.hook_out``. ``ln2.hook_in`` is
the block input as the MLP reads it: the driver hands the MLP ``ln_1(ln2.hook_in)``, the same
bits unedited, so an edit (or a gradient) there reaches the MLP only, as TransformerLens's
``hook_mlp_in`` does.
"""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("gptj"),
        embed="transformer.wte",
        layers="transformer.h",
        final_norm="transformer.ln_f",
        ln1="ln_1",
        ln2=None,
        attn="attn",
        o="out_proj",
        mlp="mlp",
        mlp_in="fc_in",
        gate=None,
        up=None,
        down="fc_out",
        # Eager GPT-J computes scores in float32 and the softmax in the scores' dtype.
        softmax_fp32=True,
        # GPT-J rotates inside attention with its own sin/cos table.
        rotary_in_attention=False,
    ),
)
