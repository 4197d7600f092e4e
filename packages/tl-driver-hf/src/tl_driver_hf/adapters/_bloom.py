"""BLOOM: ALiBi attention, fused per-head ``query_key_value``, an embedding LayerNorm.

* **Embedding norm.** ``word_embeddings_layernorm`` normalises the token embedding before
  block 0, served as ``embed_ln.*``: ``embed.hook_out`` is the embedding module's output
  (the raw lookup, ``W_E[ids]``), ``embed_ln.hook_out`` what enters the residual stream
  (TransformerLens's ``hook_embed`` on BLOOM).
* **ALiBi.** There is no position embedding and no rotary; each head adds a linear bias
  over key positions to its scores, so ``hook_attn_scores`` is
  ``alibi + q k^T / sqrt(d_head)`` (masked), as in HookedTransformer.
* **Residual inside the sublayers.** The attention and MLP modules return their output
  plus the residual, so ``attn.hook_out`` / ``mlp.hook_out`` fire at the output
  projections (``dense`` / ``dense_4h_to_h``): the sublayers' contributions.

Attention is computed inside ``BloomAttention`` (not through ``AttentionInterface``), so the
driver runs its hooked re-implementation there (``inline_attention="bloom"``).
"""

from __future__ import annotations

from tl_core.architecture import family_named
from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        description=family_named("bloom"),
        embed="transformer.word_embeddings",
        embed_norm="transformer.word_embeddings_layernorm",
        layers="transformer.h",
        final_norm="transformer.ln_f",
        ln1="input_layernorm",
        ln2="post_attention_layernorm",
        attn="self_attention",
        q=None,
        k=None,
        v=None,
        qkv="query_key_value",
        qkv_layout="heads",
        o="dense",
        mlp="mlp",
        mlp_in="dense_h_to_4h",
        gate=None,
        up=None,
        down="dense_4h_to_h",
        inline_attention="bloom",
        sublayers_add_residual=True,
    ),
)
