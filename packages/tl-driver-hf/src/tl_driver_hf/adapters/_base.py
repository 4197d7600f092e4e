"""``ArchitectureAdapter``: where one transformers family keeps each canonical site.

An adapter is plain data: dotted module paths (relative to the ``*ForCausalLM`` module for
model-level parts, to one decoder layer for block parts) and how transformers' modules of the
family compute (linear kind, fused-projection layout, inline attention, ...). What the family
*is* (its norms and where they sit, positions, MLP variant, the configs it cannot describe)
is its ``tl_core.architecture.FamilyDescription``, which the adapter refers to and never
restates; ``__post_init__`` checks that the paths agree with it. The driver turns an adapter
into torch hooks; no adapter holds code that runs in the forward pass. Importing this module
is cheap (no torch, no transformers), so support checks and entry-point scans can read the
table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from tl_core.architecture import FamilyDescription

__all__ = ["ArchitectureAdapter", "LinearKind"]

#: ``"linear"``: ``nn.Linear`` (weight ``[out, in]``); ``"conv1d"``: GPT-2's ``Conv1D``
#: (weight ``[in, out]``).
LinearKind = Literal["linear", "conv1d"]


@dataclass(frozen=True)
class ArchitectureAdapter:
    """How one transformers family maps onto the canonical hook tree.

    Attributes:
        description: What the family is (``tl_core.architecture.FamilyDescription``): its
            name and lookup keys (``family``, ``model_types``, ``architectures`` read from
            it), norms, positions, MLP variant, config requirements. Paths below exist
            exactly where it says the module does.
        embed: Path of the token embedding module.
        layers: Path of the ``ModuleList`` of decoder layers.
        final_norm: Path of the final norm, or ``None`` when the unembedding reads the last
            block's output without one (or, with ``readout_opaque``, through something tl
            does not read).
        lm_head: Path of the unembedding ``Linear``.
        pos_embed: Path of the learned position embedding, or ``None``.
        embed_norm: Path of a norm applied to the embedding before the first block (BLOOM),
            or ``None``.
        head_dense: Path of a masked-LM head transform's dense projection, which reads the
            last block's output (BERT's ``cls.predictions.transform.dense``), or ``None``;
            ``final_norm`` is then the transform's norm. Served as ``mlm_head.hook_in``/
            ``hook_out``.
        head_act: Path of the transform's activation module between ``head_dense`` and the
            final norm (certification checks the norm reads it), or ``None``.
        token_type_embed: Path of the token-type (segment) embedding whose rows are added to
            the token embedding (BERT), or ``None``.
        ln1: Pre-attention norm inside a layer, or ``None`` (OLMo 2 has none). On post-LN
            blocks (``norm_after_residual``, BERT) the norm after attention's residual add.
        ln2: Pre-MLP norm, or ``None``; on post-LN blocks the norm after the MLP's add.
        ln1_post: Norm applied to the attention output (sandwich norms), or ``None``.
        ln2_post: Norm applied to the MLP output, or ``None``.
        attn: Attention module inside a layer.
        attention_core: The module inside ``attn`` that calls transformers'
            ``AttentionInterface``, where that is not ``attn`` itself (BERT's ``self``: its
            ``attention`` also holds the output projection and the norm), or ``None``.
        q: Query projection inside ``attn`` (``None`` when fused into ``qkv``).
        k: Key projection inside ``attn``.
        v: Value projection inside ``attn``.
        qkv: Fused ``[q | k | v]`` projection inside ``attn``, or ``None``.
        o: Output projection inside ``attn``.
        q_norm: Query norm inside ``attn`` (QK-norm families), or ``None``.
        k_norm: Key norm inside ``attn``, or ``None``.
        qk_norm_layout: How the QK-norms see queries and keys: ``"positions_first"``
            (``b p h dh``, Qwen3), ``"heads_first"`` (``b h p dh``, Gemma 3) or ``"flat"``
            (``b p (h dh)``, all heads of a position normalised together, OLMo 2). tl serves
            every layout as ``b p h dh``.
        q_latent: The module inside ``attn`` whose output is multi-head latent attention's
            compressed query latent (DeepSeek's ``q_a_layernorm``), served as
            ``attn.hook_q_latent``; ``q_up`` is the projection expanding it into every
            head's query (``q_b_proj``).
        q_up: See ``q_latent``.
        kv_latent: The module inside ``attn`` whose output is the compressed key/value
            latent (``kv_a_layernorm``), served as ``attn.hook_kv_latent``; ``kv_up``
            expands it into every head's unrotated key part and value (``kv_b_proj``).
        kv_up: See ``kv_latent``.
        mixer: The state-space mixer inside a layer (Mamba's ``mixer``), where the block is
            ``x + mixer(ln1(x))`` instead of attention and an MLP, or ``None``; served as
            ``mixer.hook_in``/``hook_out``.
        mlp: MLP (or mixture-of-experts block) inside a layer.
        mlp_in: Input projection of a non-gated MLP, inside ``mlp``.
        gate: Gate projection of a gated MLP, inside ``mlp``.
        up: Up (linear) projection of a gated MLP, inside ``mlp``.
        gate_up: Fused ``[gate | up]`` projection, inside ``mlp``.
        down: Output projection, inside ``mlp``.
        linear: Weight layout of the projections.
        router: The router inside ``mlp`` (mixture of experts): a module returning
            ``(logits, top-k weights, top-k indices)`` for the flattened positions.
        experts: The routed experts inside ``mlp`` (one module returning their weighted
            sum), served as ``mlp.experts.hook_out`` where a shared expert is added after.
        shared_expert: The shared expert inside ``mlp`` (a gated MLP every position runs),
            with ``shared_parts`` its ``(gate, up, down)`` projections inside it.
        shared_parts: See ``shared_expert``.
        shared_expert_gate: The Linear inside ``mlp`` whose sigmoid scales the shared
            expert's output (Qwen2-MoE), or ``None``.
        expert_in: Parameter inside ``mlp`` stacking every expert's input projection as
            ``[experts, out, d_model]`` (transformers 5's batched experts, Mixtral's
            ``"experts.gate_up_proj"``), or ``None``; compatibility mode folds the pre-MLP
            norm into it.
        softmax_fp32: Whether eager attention takes the softmax in float32.
        absent: Canonical templates (``"blocks.{i}.attn.hook_cos"``) transformers' modules
            of the family do not let the hf driver serve, with the reason (beyond what the
            description lacks, ``FamilyDescription.absent_templates``).
        verified: Whether the driver's test suite checks this family hook by hook.
        qkv_layout: How ``qkv`` is laid out: ``"blocks"`` (``[q | k | v]``) or ``"heads"``
            (per head ``[q_h | k_h | v_h]``, GPT-NeoX).
        query_prescaled: Whether the attention module scales queries before calling
            attention (OPT); ``hook_q``/``hook_k`` then fire at the projections (unscaled).
        pos_offset: Rows of the position table before position 0 (OPT: 2).
        position_ids_start: The position id the model gives a prompt's first token, where
            its embedding reads the ids as given (RoBERTa: ``padding_idx + 1``); the driver
            numbers positions from it, and rows before it are not ``W_pos``.
        mlp_inline: Whether the MLP projections sit directly in the layer (``mlp`` is
            ``""``); ``mlp.hook_in``/``hook_out`` then fire at ``mlp_in``'s input and
            ``down``'s output.
        flat_mlp: Whether the layer flattens batch and position before its MLP half (OPT);
            the hooks there see ``[batch, pos, ...]`` again.
        rotary_in_attention: Whether attention receives its rotary table as the
            ``position_embeddings`` argument (then ``attn.hook_cos``/``hook_sin`` fire
            there); ``False`` where the module builds it itself (GPT-J).
        inline_attention: The family computes attention inside its module instead of calling
            ``AttentionInterface`` (GPT-Neo, BLOOM, Falcon): the name of the faithful
            re-implementation in ``tl_driver_hf._runtime._inline_attention`` that replaces the
            attention module's forward for the duration of each run.
        sublayers_add_residual: Whether the attention and MLP modules return their output
            plus the residual (BLOOM); ``attn.hook_out``/``mlp.hook_out`` then fire at the
            outputs of ``o`` and ``down``.
        mlp_out_inplace: Whether the layer adds into the MLP's output in place (Falcon);
            ``mlp.hook_out`` then hands the layer a copy, so cached values stay intact.
        readout_opaque: Whether the unembedding reads something other than the last block's
            output through at most one norm module (a head transform such as BERT's dense,
            activation and norm, or a norm computed without a module): the logit-lens
            readout and ``start_at_layer`` runs to the logits are then refused.
    """

    description: FamilyDescription
    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    final_norm: str | None = "model.norm"
    lm_head: str = "lm_head"
    pos_embed: str | None = None
    embed_norm: str | None = None
    token_type_embed: str | None = None
    head_dense: str | None = None
    head_act: str | None = None
    ln1: str | None = "input_layernorm"
    ln2: str | None = "post_attention_layernorm"
    ln1_post: str | None = None
    ln2_post: str | None = None
    attn: str = "self_attn"
    attention_core: str | None = None
    q: str | None = "q_proj"
    k: str | None = "k_proj"
    v: str | None = "v_proj"
    qkv: str | None = None
    o: str = "o_proj"
    q_norm: str | None = None
    k_norm: str | None = None
    qk_norm_layout: Literal["positions_first", "heads_first", "flat"] = "positions_first"
    q_latent: str | None = None
    q_up: str | None = None
    kv_latent: str | None = None
    kv_up: str | None = None
    mixer: str | None = None
    mlp: str = "mlp"
    mlp_in: str | None = None
    gate: str | None = "gate_proj"
    up: str | None = "up_proj"
    gate_up: str | None = None
    down: str | None = "down_proj"
    linear: LinearKind = "linear"
    router: str | None = None
    experts: str | None = None
    shared_expert: str | None = None
    shared_parts: tuple[str, str, str] | None = None
    shared_expert_gate: str | None = None
    expert_in: str | None = None
    softmax_fp32: bool = True
    absent: Mapping[str, str] = field(default_factory=dict)
    verified: bool = True
    qkv_layout: Literal["blocks", "heads"] = "blocks"
    query_prescaled: bool = False
    pos_offset: int = 0
    position_ids_start: int = 0
    mlp_inline: bool = False
    flat_mlp: bool = False
    rotary_in_attention: bool = True
    inline_attention: str | None = None
    sublayers_add_residual: bool = False
    mlp_out_inplace: bool = False
    readout_opaque: bool = False

    def __post_init__(self) -> None:
        problems = _disagreements(self)
        if problems:
            raise ValueError(
                f"ArchitectureAdapter {self.description.family!r}: its paths disagree with its "
                f"description: {'; '.join(problems)}"
            )

    @property
    def family(self) -> str:
        """The description's family name (``"llama"``)."""
        return self.description.family

    @property
    def model_types(self) -> tuple[str, ...]:
        """The description's ``config.model_type`` values."""
        return self.description.model_types

    @property
    def architectures(self) -> tuple[str, ...]:
        """The description's class names."""
        return self.description.architectures

    def matches_hub_id(self, name: str) -> bool:
        """Whether ``name`` looks like a hub id of this family."""
        return any(re.search(p, name, flags=re.IGNORECASE) for p in self.description.hub_patterns)

    def absent_templates(self) -> dict[str, str]:
        """Every template this family lacks despite its ``ModelInfo``, with the reason: the
        adapter's ``absent``, what transformers' modules hide from the hf driver, then what
        the description lacks."""
        reasons = dict(self.absent)
        if self.description.rotary and not self.rotary_in_attention:
            for suffix in ("hook_cos", "hook_sin"):
                reasons.setdefault(
                    f"blocks.{{i}}.attn.{suffix}",
                    f"{self.family} rotates q/k inside attention with a table it builds there; "
                    f"tl has no hook on that table (hook_rot_q/hook_rot_k hold the result)",
                )
        for template, why in self.description.absent_templates().items():
            reasons.setdefault(template, why)
        return reasons


def _disagreements(adapter: ArchitectureAdapter) -> list[str]:
    """Where a path's presence says something else than the description (empty: agreed)."""
    d = adapter.description
    if d.blocks == "opaque":
        sublayers = {}
    elif d.blocks == "mixer":
        sublayers = {"mixer": d.blocks == "mixer"}
    else:
        sublayers = {
            "ln1": d.norm_before_attn or d.norm_after_residual,
            "ln2": d.norm_before_mlp or d.norm_after_residual,
            "ln1_post": d.norm_after_attn,
            "ln2_post": d.norm_after_mlp,
            "q_norm": d.qk_norm != "none",
            "k_norm": d.qk_norm != "none",
        }
    expected = {
        **sublayers,
        "pos_embed": d.positions == "learned",
        "embed_norm": d.norm_after_embed,
        "token_type_embed": d.token_types,
        "head_dense": d.head_transform,
    }
    problems = [
        f"{name}={getattr(adapter, name)!r} but the description says "
        f"{'there is one' if want else 'there is none'}"
        for name, want in expected.items()
        if (getattr(adapter, name) is not None) != want
    ]
    if d.norm_before_unembed is True and adapter.final_norm is None:
        problems.append("final_norm=None but the description has a final norm")
    if d.norm_before_unembed is not True and adapter.final_norm is not None:
        problems.append(f"final_norm={adapter.final_norm!r} but the description has none")
    if d.blocks == "attention_mlp" and not d.moe:
        gated = adapter.gate is not None or adapter.gate_up is not None
        if gated != d.gated:
            problems.append(
                f"gate={adapter.gate!r}, gate_up={adapter.gate_up!r} but the description's MLP "
                f"is {d.mlp_variant}"
            )
    if adapter.q_norm is not None and (adapter.qk_norm_layout == "flat") != (
        d.qk_norm == "across_heads"
    ):
        problems.append(
            f"qk_norm_layout={adapter.qk_norm_layout!r} but the description's QK-norm is "
            f"{d.qk_norm.replace('_', ' ')}"
        )
    return problems
