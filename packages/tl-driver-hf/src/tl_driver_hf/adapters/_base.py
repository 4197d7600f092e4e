"""``ArchitectureAdapter``: where one transformers family keeps each canonical site.

An adapter is plain data: dotted module paths (relative to the ``*ForCausalLM`` module for
model-level parts, to one decoder layer for block parts), a few structural flags and the
family's deviations from the hook vocabulary. The driver turns it into torch hooks; no
adapter holds code that runs in the forward pass. Importing this module is cheap (no torch,
no transformers), so support checks and entry-point scans can read the table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tl_core import ModelInfo
from tl_core.driver_api import NormKind as _CoreNormKind, model_info_from_config, normalization_type

__all__ = ["ArchitectureAdapter", "LinearKind", "NormKind"]

#: How a norm normalizes and applies its weight: tl-core's one vocabulary (``"layernorm"``,
#: ``"rms"``, ``"rms_weight_first"``, ``"rms_plus_one"``), shared with every driver.
NormKind = _CoreNormKind

#: ``"linear"``: ``nn.Linear`` (weight ``[out, in]``); ``"conv1d"``: GPT-2's ``Conv1D``
#: (weight ``[in, out]``).
LinearKind = Literal["linear", "conv1d"]


@dataclass(frozen=True)
class ArchitectureAdapter:
    """How one transformers family maps onto the canonical hook tree.

    Attributes:
        family: Short family name (``"llama"``); shown in listings and errors.
        model_types: The ``config.model_type`` values this adapter serves.
        architectures: ``*ForCausalLM`` class names it serves (``config.architectures``).
        embed: Path of the token embedding module.
        layers: Path of the ``ModuleList`` of decoder layers.
        final_norm: Path of the final norm, or ``None`` when the unembedding reads the last
            block's output without one (or, with ``readout_opaque``, through something tl
            does not read).
        lm_head: Path of the unembedding ``Linear``.
        pos_embed: Path of the learned position embedding, or ``None``.
        embed_norm: Path of a norm applied to the embedding before the first block (BLOOM),
            or ``None``.
        ln1: Pre-attention norm inside a layer, or ``None`` (OLMo 2 has none).
        ln2: Pre-MLP norm, or ``None``.
        ln1_post: Norm applied to the attention output (sandwich norms), or ``None``.
        ln2_post: Norm applied to the MLP output, or ``None``.
        attn: Attention module inside a layer.
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
        norm: How every norm of the family applies its weight.
        rotary: Whether q/k are rotated inside attention (then ``hook_q``/``hook_k`` come
            from the projections and ``hook_rot_q``/``hook_rot_k`` from attention).
        parallel: Whether attention and MLP read the same block input.
        moe: Whether the MLP is a mixture of experts (per-neuron hooks are absent).
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
        embed_scaled: Whether the embedding module multiplies its lookup by its own
            ``embed_scale`` buffer (Gemma); ``embed.hook_out`` is the module's (scaled)
            output, and ``W_E`` is scaled alike.
        softmax_fp32: Whether eager attention takes the softmax in float32.
        attn_softcap: Config field of the attention-logit soft-cap, if any.
        final_softcap: Config field of the final-logit soft-cap, if any.
        absent: Canonical templates (``"blocks.{i}.ln1.hook_scale"``) the family lacks
            although its ``ModelInfo`` suggests them, with the reason.
        hub_patterns: Regular expressions matching hub ids of this family, for offline
            support checks.
        known_models: Hub ids of well-known checkpoints of this family.
        verified: Whether the driver's test suite checks this family hook by hook.
        qkv_layout: How ``qkv`` is laid out: ``"blocks"`` (``[q | k | v]``) or ``"heads"``
            (per head ``[q_h | k_h | v_h]``, GPT-NeoX).
        query_prescaled: Whether the attention module scales queries before calling
            attention (OPT); ``hook_q``/``hook_k`` then fire at the projections (unscaled).
        pos_offset: Rows of the position table before position 0 (OPT: 2).
        mlp_inline: Whether the MLP projections sit directly in the layer (``mlp`` is
            ``""``); ``mlp.hook_in``/``hook_out`` then fire at ``mlp_in``'s input and
            ``down``'s output.
        flat_mlp: Whether the layer flattens batch and position before its MLP half (OPT);
            the hooks there see ``[batch, pos, ...]`` again.
        parallel_field: Config field that decides ``parallel`` per checkpoint, if any.
        config_requires: Config values the adapter assumes, with the reason when one differs.
        rotary_in_attention: Whether attention receives its rotary table as the
            ``position_embeddings`` argument (then ``attn.hook_cos``/``hook_sin`` fire
            there); ``False`` where the module builds it itself (GPT-J).
        inline_attention: The family computes attention inside its module instead of calling
            ``AttentionInterface`` (GPT-Neo, BLOOM, Falcon): the name of the faithful
            re-implementation in ``tl_driver_hf._inline_attention`` that replaces the
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

    family: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    final_norm: str | None = "model.norm"
    lm_head: str = "lm_head"
    pos_embed: str | None = None
    embed_norm: str | None = None
    ln1: str | None = "input_layernorm"
    ln2: str | None = "post_attention_layernorm"
    ln1_post: str | None = None
    ln2_post: str | None = None
    attn: str = "self_attn"
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
    norm: NormKind = "rms"
    rotary: bool = True
    parallel: bool = False
    moe: bool = False
    router: str | None = None
    experts: str | None = None
    shared_expert: str | None = None
    shared_parts: tuple[str, str, str] | None = None
    shared_expert_gate: str | None = None
    expert_in: str | None = None
    embed_scaled: bool = False
    softmax_fp32: bool = True
    attn_softcap: str | None = None
    final_softcap: str | None = None
    absent: Mapping[str, str] = field(default_factory=dict)
    hub_patterns: tuple[str, ...] = ()
    known_models: tuple[str, ...] = ()
    verified: bool = True
    qkv_layout: Literal["blocks", "heads"] = "blocks"
    query_prescaled: bool = False
    pos_offset: int = 0
    mlp_inline: bool = False
    flat_mlp: bool = False
    parallel_field: str | None = None
    config_requires: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    rotary_in_attention: bool = True
    inline_attention: str | None = None
    sublayers_add_residual: bool = False
    mlp_out_inplace: bool = False
    readout_opaque: bool = False

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate (separate or fused)."""
        return self.gate is not None or self.gate_up is not None

    @property
    def sandwich(self) -> bool:
        """Whether sublayer outputs are normalised before joining the residual stream."""
        return self.ln1_post is not None or self.ln2_post is not None

    def is_parallel(self, config: Any) -> bool:
        """Whether attention and MLP read the same block input in this checkpoint."""
        if self.parallel_field is not None:
            return bool(getattr(config, self.parallel_field, self.parallel))
        return self.parallel

    def config_problems(self, config: Any) -> list[str]:
        """Why this adapter cannot serve ``config`` (empty when it can)."""
        return [
            f"{name}={getattr(config, name, None)!r} (expected {want!r}): {why}"
            for name, (want, why) in self.config_requires.items()
            if getattr(config, name, want) != want
        ]

    def matches_hub_id(self, name: str) -> bool:
        """Whether ``name`` looks like a hub id of this family."""
        return any(re.search(p, name, flags=re.IGNORECASE) for p in self.hub_patterns)

    def model_info(self, config: Any) -> ModelInfo:
        """The ``ModelInfo`` of a transformers config of this family.

        Args:
            config: A ``PretrainedConfig`` (or anything with its attributes).

        Returns:
            Sizes from the config (tl-core's one reader), structure from this adapter.
        """
        architectures = getattr(config, "architectures", None) or [self.architectures[0]]
        return model_info_from_config(
            config,
            normalization_type=normalization_type(self.norm),
            positional_embedding_type=(
                "standard" if self.pos_embed else "rotary" if self.rotary else "none"
            ),
            gated_mlp=self.gated,
            parallel_attn_mlp=self.is_parallel(config),
            sandwich_norm=self.sandwich,
            qk_norm=self.q_norm is not None,
            embed_norm=self.embed_norm is not None,
            moe=self.moe,
            architecture=str(architectures[0]),
        )

    def absent_templates(self) -> dict[str, str]:
        """Every template this family lacks despite its ``ModelInfo``, with the reason."""
        reasons = dict(self.absent)
        if self.ln1 is None:
            for suffix in ("hook_in", "hook_scale", "hook_normalized", "hook_out"):
                reasons.setdefault(
                    f"blocks.{{i}}.ln1.{suffix}",
                    f"{self.family} has no norm before attention (attention reads the "
                    f"residual stream directly)",
                )
        if self.ln2 is None:
            suffixes: tuple[str, ...] = ("hook_scale", "hook_normalized", "hook_out")
            # A parallel block without any norm has no input of a norm before the MLP; with
            # one shared norm (GPT-J), ln2.hook_in is the block input the MLP's copy reads.
            suffixes = ("hook_in", *suffixes) if self.parallel and self.ln1 is None else suffixes
            for suffix in suffixes:
                reasons.setdefault(
                    f"blocks.{{i}}.ln2.{suffix}",
                    f"{self.family} has no norm before the MLP (the MLP reads the residual "
                    f"stream directly)",
                )
        if self.rotary and not self.rotary_in_attention:
            for suffix in ("hook_cos", "hook_sin"):
                reasons.setdefault(
                    f"blocks.{{i}}.attn.{suffix}",
                    f"{self.family} rotates q/k inside attention with a table it builds there; "
                    f"tl has no hook on that table (hook_rot_q/hook_rot_k hold the result)",
                )
        if self.moe:
            for suffix in ("hook_pre", "hook_pre_linear", "hook_post"):
                reasons.setdefault(
                    f"blocks.{{i}}.mlp.{suffix}",
                    f"{self.family} routes each token through a few of its experts, so "
                    f"there is no single layer of MLP neurons; use mlp.hook_in / "
                    f"mlp.hook_out",
                )
        return reasons
