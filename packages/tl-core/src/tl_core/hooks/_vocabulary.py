"""The canonical hook vocabulary: one row per named site of a decoder-only LM's forward pass.

Every name a user can type resolves (see ``tl_core.hooks._resolution``) to one of the concrete names
built from ``CANONICAL_TEMPLATES``. A template carries the tensor layout, what the site
holds, its HookedTransformer name and the structural condition under which a model has it.

Structural decisions (the ``requires`` column):

* ``blocks.{i}.ln2.hook_in`` is the input of the pre-MLP norm. On sequential blocks that is
  the residual stream between attention and MLP (``hook_resid_mid``), which a norm-less
  sequential model also has, so the site needs only a sequential block or a norm. On
  parallel blocks (GPT-NeoX) it is the block input as the MLP's own norm reads it: an edit
  there reaches the MLP only. ``hook_resid_mid`` does not exist on parallel blocks.
* The rest of ``ln2`` (``hook_scale``, ``hook_normalized``, ``hook_out``) is the MLP's input
  norm and needs only a norm: parallel blocks with two norms (NeoX) keep it. Where one
  norm feeds both sublayers (GPT-J, Falcon-7B) it fires as ``ln1``; ``ln2.hook_in`` is still
  the block input as the MLP reads it (the MLP gets its own copy of the shared norm, as in
  TransformerLens, so an edit there reaches the MLP only), and drivers declare the other
  ``ln2`` sites non-fireable: an edit there would also change what attention reads,
  which the name does not promise. ``ln1``'s four sites, every
  ``ln_final`` site and ``ln1.hook_in`` need a norm; ``ln1.hook_in`` always equals
  ``blocks.{i}.hook_in`` and is kept for symmetry with the other norms.
* On post-LN blocks (BERT: ``h = ln1(x + attn(x)); out = ln2(h + mlp(h))``, see
  ``ModelInfo.post_residual_norm``) ``ln1`` and ``ln2`` are the norms after the residual
  adds: ``ln1.hook_in`` is ``hook_in + attn.hook_out``, ``ln1.hook_out`` the MLP's input,
  ``ln2.hook_in`` is ``ln1.hook_out + mlp.hook_out`` and ``ln2.hook_out`` the block's output.
* ``embed_ln.*`` is BLOOM's norm on the embedding (``word_embeddings_layernorm``):
  ``embed.hook_out`` is the raw lookup and ``embed_ln.hook_out`` what enters block 0.
* ``attn.q_norm.*`` and ``attn.k_norm.*`` are the QK-norm of Qwen3, Gemma 3 and OLMo 2,
  always served per head (``b p h dh``; the scale ``b p h 1``). OLMo 2 normalises all heads
  of a position together, so its scale is the same for every head of a position.
* ``embed.hook_in`` and ``pos_embed.hook_in`` are the token and position ids (integers), and
  ``attn.hook_cos``/``attn.hook_sin`` the rotary table a block rotates q/k with: inputs of a
  computation rather than activations, served because TransformerLens 4.x serves them.
* ``attn.hook_result`` is opt-in (it costs ``n_heads`` copies of the residual width), so
  ``canonical_hook_names`` lists it only when asked. So are ``attn.hook_q_input``,
  ``hook_k_input`` and ``hook_v_input``: while a driver runs with split inputs, each head
  reads its own copy of the block input (normalised by ``ln1`` per head), so a gradient
  there is that head's alone; attribution patching turns them on for its edge sweep.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from tl_core._errors import ConfigError, HookNameError
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._requirements import MISSING_BECAUSE, HookRequirement, requirement_met

__all__ = [
    "BEFORE_BLOCKS",
    "CANONICAL_TEMPLATES",
    "LAYOUTS",
    "STACK_PREFIXES",
    "MISSING_BECAUSE",
    "HookRequirement",
    "HookTemplate",
    "canonical_hook_names",
    "is_canonical",
    "on_decoder_positions",
    "stack_of",
    "requirement_met",
    "split_canonical",
]


#: Every layout a canonical hook can have. ``b`` batch, ``p`` position, ``d`` d_model,
#: ``h`` heads (key/value heads for ``hook_k``/``hook_v``/``hook_rot_k``), ``dh`` d_head,
#: ``q``/``k`` query/key positions, ``dm`` d_mlp, ``vocab`` d_vocab, ``r`` the rotary
#: width (``rotary_dim``), ``e`` experts, ``k`` experts per token (integer ids), ``ds``
#: the shared expert's hidden width, ``lq``/``lkv`` the query and key/value latents of
#: multi-head latent attention, ``1`` a kept axis; ``b p`` alone holds integer ids.
LAYOUTS: frozenset[str] = frozenset(
    {
        "b p",
        "b p d",
        "b p 1",
        "b p h dh",
        "b p h 1",
        "b p r",
        "b h q k",
        "b p dm",
        "b p ds",
        "b p lq",
        "b p lkv",
        "b p vocab",
        "b p h d",
        "b p e",
        "b p k",
    }
)

_BLOCK_PREFIX = "blocks.{i}."
#: The name prefixes of the stacks a model's blocks sit in (``ModelInfo.stacks``):
#: ``blocks`` for one-stack models, the encoder's and decoder's of an encoder-decoder.
STACK_PREFIXES: tuple[str, ...] = ("blocks", "encoder_blocks", "decoder_blocks")


@dataclass(frozen=True)
class HookTemplate:
    """One row of the hook vocabulary.

    Attributes:
        template: The canonical name, with ``{i}`` for the block index
            (``"blocks.{i}.attn.hook_q"``); global hooks have no ``{i}``.
        layout: The tensor's axes, one of ``LAYOUTS``.
        description: What the site holds.
        legacy: The HookedTransformer name of the same tensor (identical where the names
            agree), or ``None`` where HookedTransformer has no hook holding it.
        requires: The structural condition under which a model has the site, or ``None``
            when every decoder-only model has it: ``"standard_pos"`` (learned positional
            embedding), ``"rotary"``, ``"gated_mlp"``, ``"mlp_norm_input"`` (attention and
            MLP in sequence, or a norm before the MLP), ``"embed_norm"`` (a norm on the
            embedding, BLOOM), ``"token_types"`` (a token-type embedding, BERT), ``"head_transform"`` (a masked-LM
            head transform before the final norm), ``"moe"`` (a mixture of experts), ``"shared_expert"`` (a mixture
            of experts with a shared expert), ``"q_latent"``/``"kv_latent"`` (multi-head latent
            attention with a compressed query / key-value latent), ``"sandwich_norm"``, ``"qk_norm"``, ``"attn_result"`` (opt-in),
            ``"split_qkv_input"`` (opt-in) or ``"norm"``.
    """

    template: str
    layout: str
    description: str
    legacy: str | None = None
    requires: HookRequirement | None = None

    @property
    def per_block(self) -> bool:
        """Whether the template has a block index."""
        return self.template.startswith(_BLOCK_PREFIX)

    @property
    def statistic(self) -> bool:
        """Whether the site is a norm's scale or pre-weight value (it needs the norm's weight
        rule, ``ModelInfo.normalization_type``)."""
        return self.template.endswith((".hook_scale", ".hook_normalized"))

    @property
    def suffix(self) -> str:
        """The part after ``blocks.{i}.`` (the whole name for global hooks)."""
        return self.template[len(_BLOCK_PREFIX) :] if self.per_block else self.template

    def format(self, layer: int | None = None, stack: str = "blocks") -> str:
        """The concrete name for block ``layer``.

        Args:
            layer: The block index; ignored for global hooks.
            stack: The stack the block sits in (one of ``STACK_PREFIXES``).

        Returns:
            ``"blocks.3.attn.hook_q"`` for ``format(3)`` of ``"blocks.{i}.attn.hook_q"``.

        Raises:
            HookNameError: A per-block template without a layer, or a negative layer.
        """
        if not self.per_block:
            return self.template
        if layer is None or layer < 0:
            raise HookNameError(
                f"{self.template!r} needs a block index >= 0, got {layer!r}: write e.g. "
                f"{self.template.format(i=0)!r}."
            )
        return f"{stack}.{layer}.{self.suffix}"


def _norm_family(
    prefix: str,
    what: str,
    requires: HookRequirement,
    in_note: str,
    *,
    layout: str = "b p d",
    scale_layout: str = "b p 1",
) -> tuple[HookTemplate, ...]:
    """The four sites of one norm: input, scale, normalized (pre-weight), output."""
    return (
        HookTemplate(f"{prefix}.hook_in", layout, f"Input of {what} ({in_note}).", None, requires),
        HookTemplate(
            f"{prefix}.hook_scale",
            scale_layout,
            f"Divisor of {what}: sqrt(var + eps) for LayerNorm, sqrt(mean(x^2) + eps) for RMSNorm.",
            f"{prefix}.hook_scale",
            requires,
        ),
        HookTemplate(
            f"{prefix}.hook_normalized",
            layout,
            f"Normalized value of {what}, after centring/scaling and before its weight and bias.",
            f"{prefix}.hook_normalized",
            requires,
        ),
        HookTemplate(
            f"{prefix}.hook_out",
            layout,
            f"Output of {what}, weight and bias applied.",
            None,
            requires,
        ),
    )


_LN1 = _norm_family(
    "blocks.{i}.ln1",
    "the pre-attention norm (on post-LN blocks, BERT: the norm after attention's residual add)",
    "norm",
    "= hook_in; on post-LN blocks hook_in + attn.hook_out",
)
_LN1_POST = _norm_family(
    "blocks.{i}.ln1_post",
    "the post-attention norm (sandwich-norm models)",
    "sandwich_norm",
    "= attn.hook_out",
)
# ln2.hook_in has its own row: it is resid_mid on sequential blocks, which need no norm.
_LN2_REST = _norm_family(
    "blocks.{i}.ln2",
    "the pre-MLP norm (on post-LN blocks, BERT: the norm after the MLP's residual add, whose "
    "output is the block's; on an encoder-decoder's decoder blocks the norm before "
    "cross-attention, as in TransformerLens)",
    "norm",
    "",
)[1:]
_Q_NORM = _norm_family(
    "blocks.{i}.attn.q_norm",
    "the query norm (QK-norm models)",
    "qk_norm",
    "= attn.hook_q",
    layout="b p h dh",
    scale_layout="b p h 1",
)
_K_NORM = _norm_family(
    "blocks.{i}.attn.k_norm",
    "the key norm (QK-norm models; h = n_key_value_heads)",
    "qk_norm",
    "= attn.hook_k",
    layout="b p h dh",
    scale_layout="b p h 1",
)
_LN2_POST = _norm_family(
    "blocks.{i}.ln2_post",
    "the post-MLP norm (sandwich-norm models)",
    "sandwich_norm",
    "= mlp.hook_out",
)
_LN3 = _norm_family(
    "blocks.{i}.ln3",
    "the pre-MLP norm of an encoder-decoder's decoder blocks, after cross-attention (ln2 is "
    "then the norm before cross-attention, as in TransformerLens; on post-LN blocks, BART: the "
    "norm after the MLP's residual add, whose output is the block's)",
    "cross_attention",
    "the residual stream after cross-attention; on post-LN blocks ln2.hook_out + mlp.hook_out",
)
_CROSS_ATTN = (
    HookTemplate(
        "blocks.{i}.cross_attn.hook_in",
        "b p d",
        "Input of cross-attention's queries (= ln2.hook_out; ln1.hook_out on post-LN blocks).",
        None,
        "cross_attention",
    ),
    HookTemplate(
        "blocks.{i}.cross_attn.hook_q",
        "b p h dh",
        "Cross-attention's queries per head, from the decoder's stream.",
        None,
        "cross_attention",
    ),
    HookTemplate(
        "blocks.{i}.cross_attn.hook_k",
        "b p h dh",
        "Cross-attention's keys per head, from the encoder's output (p counts encoder positions).",
        None,
        "cross_attention",
    ),
    HookTemplate(
        "blocks.{i}.cross_attn.hook_v",
        "b p h dh",
        "Cross-attention's values per head, from the encoder's output (p counts encoder "
        "positions).",
        None,
        "cross_attention",
    ),
    HookTemplate(
        "blocks.{i}.cross_attn.hook_pattern",
        "b h q k",
        "Cross-attention's probabilities (after softmax): decoder positions q over encoder "
        "positions k.",
        None,
        "cross_attention",
    ),
    HookTemplate(
        "blocks.{i}.cross_attn.hook_z",
        "b p h dh",
        "Cross-attention's per-head mix of values, its output projection's input.",
        None,
        "cross_attention",
    ),
    HookTemplate(
        "blocks.{i}.cross_attn.hook_out",
        "b p d",
        "Cross-attention's output, before its residual add.",
        None,
        "cross_attention",
    ),
)
_LN_FINAL = _norm_family(
    "ln_final",
    "the final norm (with a masked-LM head transform, BERT: the transform's norm)",
    "norm",
    "= the last block's hook_out; with a head transform the activation of mlm_head.hook_out",
)
_EMBED_LN = _norm_family(
    "embed_ln",
    "the embedding norm (BLOOM, BERT)",
    "embed_norm",
    "= embed.hook_out, plus pos_embed.hook_out and token_type_embed.hook_out where they exist",
)

#: The vocabulary, in forward order: global hooks before the blocks, one block's hooks,
#: global hooks after the blocks.
CANONICAL_TEMPLATES: tuple[HookTemplate, ...] = (
    HookTemplate(
        "embed.hook_in",
        "b p",
        "Token ids entering the embedding (integers; read-only).",
        "hook_tokens",
    ),
    HookTemplate(
        "embed.hook_out",
        "b p d",
        "Token embedding as it enters the residual stream, before positional embeddings; "
        "includes the scale the model applies to it (Gemma's sqrt(d_model)), so it equals "
        "W_E[tokens] with W_E scaled alike.",
        "hook_embed",
    ),
    *_EMBED_LN,
    HookTemplate(
        "pos_embed.hook_in",
        "b p",
        "Position ids entering the learned positional embedding (integers; read-only).",
        None,
        "standard_pos",
    ),
    HookTemplate(
        "pos_embed.hook_out",
        "b p d",
        "Learned positional embedding.",
        "hook_pos_embed",
        "standard_pos",
    ),
    HookTemplate(
        "token_type_embed.hook_in",
        "b p",
        "Segment ids entering the token-type embedding (integers; read-only; BERT's sentence "
        "A is 0, B is 1).",
        None,
        "token_types",
    ),
    HookTemplate(
        "token_type_embed.hook_out",
        "b p d",
        "Token-type (segment) embedding rows, added to the token embedding (BERT).",
        "hook_token_type_embed",
        "token_types",
    ),
    HookTemplate(
        "blocks.{i}.hook_in",
        "b p d",
        "Residual stream entering block i.",
        "blocks.{i}.hook_resid_pre",
    ),
    *_LN1,
    HookTemplate(
        "blocks.{i}.mixer.hook_in",
        "b p d",
        "Blocks built as x + mixer(norm(x)) (Mamba, Mamba-2; Nemotron-H, whose mixer is a "
        "state-space layer, attention or an MLP by layer): the mixer's input, the normalised "
        "residual stream.",
        None,
        "mixer",
    ),
    HookTemplate(
        "blocks.{i}.mixer.hook_out",
        "b p d",
        "Blocks built as x + mixer(norm(x)): the mixer's output, which the block adds to its "
        "input.",
        None,
        "mixer",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_q_input",
        "b p h d",
        "Each query head's own copy of the block input, before ln1 (opt-in: per-head gradients).",
        "blocks.{i}.hook_q_input",
        "split_qkv_input",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_k_input",
        "b p h d",
        "Each key/value head's own copy of the block input feeding its keys, before ln1 (opt-in).",
        "blocks.{i}.hook_k_input",
        "split_qkv_input",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_v_input",
        "b p h d",
        "Each key/value head's own copy of the block input feeding its values, before ln1 (opt-in).",
        "blocks.{i}.hook_v_input",
        "split_qkv_input",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_in",
        "b p d",
        "Input of the attention module (= ln1.hook_out; the block input when there is no norm "
        "before it, as on post-LN blocks).",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_q_latent",
        "b p lq",
        "Multi-head latent attention: the compressed query latent (normalised), which the "
        "query up-projection expands into every head's query.",
        None,
        "q_latent",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_kv_latent",
        "b p lkv",
        "Multi-head latent attention: the compressed key/value latent (normalised; what the "
        "engine caches), which the key/value up-projection expands into every head's "
        "unrotated key part and value.",
        None,
        "kv_latent",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_q",
        "b p h dh",
        "Queries per head, the projection's output before any QK-norm and rotary embedding.",
        "blocks.{i}.attn.hook_q",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_k",
        "b p h dh",
        "Keys per key/value head (h = n_key_value_heads), before any QK-norm and rotary embedding.",
        "blocks.{i}.attn.hook_k",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_v",
        "b p h dh",
        "Values per key/value head (h = n_key_value_heads).",
        "blocks.{i}.attn.hook_v",
    ),
    *_Q_NORM,
    *_K_NORM,
    HookTemplate(
        "blocks.{i}.attn.hook_cos",
        "b p r",
        "Cosines of the rotary table this block rotates queries and keys with, per position.",
        None,
        "rotary",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_sin",
        "b p r",
        "Sines of the rotary table this block rotates queries and keys with, per position.",
        None,
        "rotary",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_rot_q",
        "b p h dh",
        "Queries after QK-norm (if any) and the rotary embedding.",
        "blocks.{i}.attn.hook_rot_q",
        "rotary",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_rot_k",
        "b p h dh",
        "Keys per key/value head after QK-norm (if any) and the rotary embedding.",
        "blocks.{i}.attn.hook_rot_k",
        "rotary",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_attn_scores",
        "b h q k",
        "Attention scores before the softmax: scaled, soft-capped where the model does, masked.",
        "blocks.{i}.attn.hook_attn_scores",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_pattern",
        "b h q k",
        "Attention probabilities (after softmax).",
        "blocks.{i}.attn.hook_pattern",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_z",
        "b p h dh",
        "Per-head mix of values, the output projection's input.",
        "blocks.{i}.attn.hook_z",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_result",
        "b p h d",
        "Per-head output after the output projection, before the sum over heads (opt-in).",
        "blocks.{i}.attn.hook_result",
        "attn_result",
    ),
    HookTemplate(
        "blocks.{i}.attn.hook_out",
        "b p d",
        "Attention module output (before any post-attention norm).",
        "blocks.{i}.hook_attn_out",
    ),
    *_LN1_POST,
    HookTemplate(
        "blocks.{i}.ln2.hook_in",
        "b p d",
        "Input of the pre-MLP norm: the residual stream between attention and MLP on "
        "sequential blocks; on parallel blocks the block input as the MLP's norm reads it; on "
        "post-LN blocks (BERT) the sum ln1.hook_out + mlp.hook_out that ln2 normalises; on "
        "decoder blocks with cross-attention the stream between self- and cross-attention.",
        "blocks.{i}.hook_resid_mid",
        "mlp_norm_input",
    ),
    *_LN2_REST,
    *_CROSS_ATTN,
    *_LN3,
    HookTemplate(
        "blocks.{i}.mlp.hook_in",
        "b p d",
        "Input of the MLP module (= ln2.hook_out; after the pre-MLP norm; on post-LN blocks "
        "= ln1.hook_out; on decoder blocks with cross-attention ln3.hook_out, or ln2.hook_out "
        "on post-LN ones).",
    ),
    HookTemplate(
        "blocks.{i}.mlp.hook_router_logits",
        "b p e",
        "Mixture of experts: the router's logit for each expert.",
        None,
        "moe",
    ),
    HookTemplate(
        "blocks.{i}.mlp.hook_expert_weights",
        "b p e",
        "Mixture of experts: the weight each expert's output gets (0 for experts not chosen), "
        "as TransformerLens 4.x serves it; HookedTransformer 2.x gave the chosen experts' "
        "weights in the router's order (gather these with hook_expert_indices).",
        "blocks.{i}.mlp.hook_expert_weights",
        "moe",
    ),
    HookTemplate(
        "blocks.{i}.mlp.hook_expert_indices",
        "b p k",
        "Mixture of experts: the experts chosen at each position, in the router's order "
        "(integers; read-only).",
        "blocks.{i}.mlp.hook_expert_indices",
        "moe",
    ),
    HookTemplate(
        "blocks.{i}.mlp.experts.hook_out",
        "b p d",
        "Mixture of experts with a shared expert: the routed experts' output (each chosen "
        "expert's output times its weight, summed), before the shared expert's is added.",
        None,
        "shared_expert",
    ),
    HookTemplate(
        "blocks.{i}.mlp.shared_expert.hook_pre",
        "b p ds",
        "The shared expert's pre-activation (its gate projection's output).",
        None,
        "shared_expert",
    ),
    HookTemplate(
        "blocks.{i}.mlp.shared_expert.hook_pre_linear",
        "b p ds",
        "The shared expert's linear (up) branch.",
        None,
        "shared_expert",
    ),
    HookTemplate(
        "blocks.{i}.mlp.shared_expert.hook_post",
        "b p ds",
        "The shared expert's activations (the input of its output projection).",
        None,
        "shared_expert",
    ),
    HookTemplate(
        "blocks.{i}.mlp.shared_expert.hook_out",
        "b p d",
        "The shared expert's output, before its gate scales it.",
        None,
        "shared_expert",
    ),
    HookTemplate(
        "blocks.{i}.mlp.shared_expert.hook_gate",
        "b p 1",
        "The shared expert's gate logit: its output enters as sigmoid(gate) times "
        "shared_expert.hook_out (Qwen2-MoE; absent where the shared expert is not gated).",
        None,
        "shared_expert",
    ),
    HookTemplate(
        "blocks.{i}.mlp.hook_pre",
        "b p dm",
        "MLP pre-activation: the input projection's output, or the gate projection's on "
        "gated MLPs.",
        "blocks.{i}.mlp.hook_pre",
    ),
    HookTemplate(
        "blocks.{i}.mlp.hook_pre_linear",
        "b p dm",
        "Gated MLPs: the linear (up) projection's output that multiplies act(hook_pre).",
        "blocks.{i}.mlp.hook_pre_linear",
        "gated_mlp",
    ),
    HookTemplate(
        "blocks.{i}.mlp.hook_post",
        "b p dm",
        "MLP neurons: act(hook_pre), times hook_pre_linear on gated MLPs; the output "
        "projection's input.",
        "blocks.{i}.mlp.hook_post",
    ),
    HookTemplate(
        "blocks.{i}.mlp.hook_out",
        "b p d",
        "MLP module output (before any post-MLP norm).",
        "blocks.{i}.hook_mlp_out",
    ),
    *_LN2_POST,
    HookTemplate(
        "blocks.{i}.hook_out",
        "b p d",
        "Residual stream leaving block i.",
        "blocks.{i}.hook_resid_post",
    ),
    HookTemplate(
        "mlm_head.hook_in",
        "b p d",
        "Input of a masked-LM head's transform (= the last block's hook_out; BERT's "
        "cls.predictions.transform), as TransformerLens 4.3 names it.",
        None,
        "head_transform",
    ),
    HookTemplate(
        "mlm_head.hook_out",
        "b p d",
        "The head transform's dense projection, before its activation; ln_final reads the "
        "activation of it.",
        None,
        "head_transform",
    ),
    *_LN_FINAL,
    HookTemplate(
        "unembed.hook_out",
        "b p vocab",
        "Unembedding output (logits before any final soft-capping).",
        "hook_unembed",
    ),
)

_FIRST_BLOCK_ROW = next(n for n, t in enumerate(CANONICAL_TEMPLATES) if t.per_block)
#: Global hooks the forward pass reaches before the first block (inputs, embeddings).
BEFORE_BLOCKS: frozenset[str] = frozenset(
    t.template for t in CANONICAL_TEMPLATES[:_FIRST_BLOCK_ROW]
)
_BLOCK_SUFFIXES: dict[str, HookTemplate] = {t.suffix: t for t in CANONICAL_TEMPLATES if t.per_block}
_GLOBAL_NAMES: dict[str, HookTemplate] = {
    t.template: t for t in CANONICAL_TEMPLATES if not t.per_block
}
# Canonical indices have no sign and no leading zero, so each site has exactly one name.
_BLOCK_RE = re.compile(r"(blocks|encoder_blocks|decoder_blocks)\.(0|[1-9][0-9]*)\.(.+)")


def split_canonical(name: str) -> tuple[HookTemplate, int | None] | None:
    """``(template, layer)`` of a concrete canonical name; ``None`` for anything else.

    The stack a block sits in (``encoder_blocks.2.hook_out``) is ``stack_of``'s answer.

    Args:
        name: A canonical name (``"blocks.3.attn.hook_q"`` -> (its row, 3)).
    """
    template = _GLOBAL_NAMES.get(name)
    if template is not None:
        return template, None
    if "blocks." not in name:
        return None
    match = _BLOCK_RE.fullmatch(name)
    if match is None:
        return None
    template = _BLOCK_SUFFIXES.get(match.group(3))
    return None if template is None else (template, int(match.group(2)))


def stack_of(name: str) -> str | None:
    """The stack prefix of a per-block canonical name (``"encoder_blocks"``), else ``None``."""
    head = name.split(".", 1)[0]
    return head if head in STACK_PREFIXES and split_canonical(name) is not None else None


def on_decoder_positions(name: str) -> bool:
    """Whether a canonical site of an encoder-decoder lies over the decoder's positions.

    Decoder blocks' sites do, except cross-attention's keys and values (they are computed
    from the encoder's output, one row per encoder position); so do ``ln_final.*`` and
    ``unembed.*``, which read the decoder's last block. Every other site lies over the
    prompt's (the encoder's) positions.
    """
    if name.startswith("decoder_blocks."):
        return not name.endswith((".cross_attn.hook_k", ".cross_attn.hook_v"))
    return name.startswith(("ln_final.", "unembed."))


def is_canonical(name: object) -> bool:
    """Whether ``name`` is a concrete canonical hook name (``"blocks.3.hook_out"``).

    Anything else, aliases and non-strings included, is ``False``.
    """
    return isinstance(name, str) and split_canonical(name) is not None


@lru_cache(maxsize=64)
def _names_for(
    info: ModelInfo, include_attn_result: bool, include_split_qkv_input: bool
) -> tuple[str, ...]:
    def met(template: HookTemplate, model: ModelInfo) -> bool:
        return requirement_met(
            template.requires,
            model,
            include_attn_result=include_attn_result,
            include_split_qkv_input=include_split_qkv_input,
            statistic=template.statistic,
        )

    per_block = [t for t in CANONICAL_TEMPLATES if t.per_block]
    head = [t.template for t in CANONICAL_TEMPLATES if t.template in BEFORE_BLOCKS and met(t, info)]
    tail = [
        t.template
        for t in CANONICAL_TEMPLATES
        if not t.per_block and t.template not in BEFORE_BLOCKS and met(t, info)
    ]
    blocks = [
        t.format(layer, prefix)
        for prefix, stack in info.stacks
        for layer in range(stack.n_layers)
        for t in per_block
        if met(t, stack)
    ]
    return (*head, *blocks, *tail)


def canonical_hook_names(
    info: ModelInfo, *, include_attn_result: bool = False, include_split_qkv_input: bool = False
) -> list[str]:
    """Every concrete canonical hook a model with this structure has, in forward order.

    Order: ``embed``, ``pos_embed`` (learned positions only), each block's hooks in forward
    order, the ``ln_final`` hooks (models with norms), ``unembed.hook_out``. See the module
    docstring for how parallel and norm-less blocks are treated.

    Args:
        info: The model's sizes and structure.
        include_attn_result: Also list the opt-in ``blocks.{i}.attn.hook_result``.
        include_split_qkv_input: Also list the opt-in per-head inputs
            ``blocks.{i}.attn.hook_q_input``/``hook_k_input``/``hook_v_input``.

    Returns:
        A new list of names.

    Raises:
        ConfigError: ``info`` is not a ``ModelInfo`` or has a negative ``n_layers``.
    """
    if not isinstance(info, ModelInfo):
        raise ConfigError(
            f"canonical_hook_names needs a ModelInfo, got {type(info).__name__}: {info!r}"
        )
    if not isinstance(info.n_layers, int) or info.n_layers < 0:
        raise ConfigError(
            f"ModelInfo.n_layers must be an int >= 0, got {info.n_layers!r}; fix the driver's "
            f"ModelInfo."
        )
    return list(_names_for(info, bool(include_attn_result), bool(include_split_qkv_input)))
