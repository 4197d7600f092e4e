"""HookedTransformer's processed-weights convention, applied to a loaded transformers model.

``enable_compatibility`` rewrites the wrapped model's parameters in place so that its
activations follow TransformerLens' ``fold_ln`` / ``center_writing_weights`` /
``center_unembed`` / ``fold_value_biases`` processing:

- **fold_ln**: each pre-norm's weight (and bias) moves into the projections that read the
  norm's output, and the norm becomes the identity (weight ``1``, or ``0`` under Gemma's
  ``(1 + w)`` rule; bias ``0``). What reads a norm follows the block's structure: the
  pre-attention norm feeds q/k/v, and also the MLP in a parallel block with one shared
  norm (GPT-J, Falcon); the pre-MLP norm feeds the MLP's input projections, including a
  mixture of experts' router and every expert; the final norm feeds the unembedding. On
  LayerNorm models the folded weights are also centred over ``d_model`` (exact: a
  LayerNorm's output has zero mean). Norms that nothing reads linearly stay as they are:
  post-sublayer (sandwich) norms, QK-norms and BLOOM's embedding norm.
- **center_writing_weights** (LayerNorm models only; RMSNorm does not remove the mean, so
  centring would change the model): everything written to the residual stream (token and
  position embeddings, attention and MLP output weights and biases) loses its mean over
  ``d_model``.
- **center_unembed**: the unembedding (and its bias) loses its mean over the vocabulary;
  logits shift by a per-position constant, which ``softmax`` ignores. Skipped, with a
  log line, when the final logits are soft-capped: ``tanh`` does not ignore the shift.
- **fold_value_biases**: value biases move into the attention output bias.

Only models the driver loaded itself are rewritten; a user's ``hf_model`` is never
mutated. Every check runs before the first weight changes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tl_core import UnsupportedFeatureError, UserError
from tl_driver_hf._architecture._modules import LayerModules, ModelModules
from tl_driver_hf._weights._folding import (
    Projection,
    center_embedding,
    center_unembedding,
    center_writer,
    fold_norm,
    fold_value_bias,
    untie,
    value_bias_view,
)
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["CompatState", "describe_blocks", "enable_compatibility"]

_LOG = logging.getLogger(__name__)

_OPTIONS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")


@dataclass(frozen=True)
class CompatState:
    """What compatibility mode did to the weights.

    Attributes:
        fold_ln: Pre-norm weights (and biases) were folded into the layers reading them.
        center_writing_weights: Residual-stream writers were centred over ``d_model``
            (``False`` on RMSNorm models even when requested: centring would change them).
        center_unembed: The unembedding was centred over the vocabulary (``False`` under
            final-logit soft-capping even when requested).
        fold_value_biases: Value biases were folded into the attention output bias.
        notes: What was left as it is or skipped, and why (one sentence each).
    """

    fold_ln: bool
    center_writing_weights: bool
    center_unembed: bool
    fold_value_biases: bool
    notes: tuple[str, ...] = field(default=())


def _parse(options: Mapping[str, Any]) -> dict[str, bool]:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise UserError(
            f"enable_compatibility_mode got unknown option(s) {unknown}; the options are "
            f"{list(_OPTIONS)}"
        )
    parsed: dict[str, bool] = {}
    for name in _OPTIONS:
        value = options.get(name, True)
        if not isinstance(value, bool):
            raise UserError(
                f"enable_compatibility_mode option {name!r} must be a bool, got {value!r}"
            )
        parsed[name] = value
    return parsed


def describe_blocks(adapter: ArchitectureAdapter, parallel: bool) -> str:
    """One sentence naming the norms of a family's blocks and what reads them."""
    parts = [
        f"norm before attention {adapter.ln1!r}" if adapter.ln1 else "no norm before attention"
    ]
    if adapter.ln2:
        parts.append(f"norm before the MLP {adapter.ln2!r}")
    elif parallel and adapter.ln1:
        parts.append(f"the MLP reads {adapter.ln1!r} too (one norm shared by a parallel block)")
    else:
        parts.append("no norm before the MLP")
    posts = [p for p in (adapter.ln1_post, adapter.ln2_post) if p]
    if posts:
        parts.append(f"norms on the sublayer outputs {posts}")
    if adapter.description.moe:
        parts.append(
            f"a mixture-of-experts MLP (router {adapter.router!r}, experts {adapter.expert_in!r})"
        )
    kind = "LayerNorm" if adapter.description.norm == "layernorm" else "RMSNorm"
    layout = "parallel" if parallel else "sequential"
    return f"{adapter.family} has {layout} {kind} blocks: " + ", ".join(parts)


# -- the plan: which parameters each step touches -----------------------------------------


@dataclass
class _Plan:
    folds: list[tuple[nn.Module, list[Projection]]]
    writers: list[Projection]
    embeddings: list[nn.Module]
    notes: list[str]


def _refuse(adapter: ArchitectureAdapter, parallel: bool, reason: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"enable_compatibility_mode() cannot fold the {adapter.family!r} family: "
        f"{describe_blocks(adapter, parallel)}; {reason}. Use the bridge without "
        f"compatibility mode (every hook is served either way)."
    )


def _attention_readers(layer: LayerModules, adapter: ArchitectureAdapter) -> list[Projection]:
    modules = [layer.qkv] if layer.qkv is not None else [layer.q, layer.k, layer.v]
    return [Projection(m, "weight", adapter.linear) for m in modules if m is not None]


def _mlp_readers(
    layer: LayerModules, adapter: ArchitectureAdapter, parallel: bool
) -> list[Projection]:
    modules = (layer.mlp_in, layer.gate, layer.up, layer.gate_up)
    readers = [Projection(m, "weight", adapter.linear) for m in modules if m is not None]
    if adapter.description.moe:
        if layer.router is None or adapter.expert_in is None:
            raise _refuse(
                adapter,
                parallel,
                "the adapter does not name the router and the stacked expert input weights "
                "(router, expert_in) the pre-MLP norm feeds",
            )
        # The router is a bare weight in transformers 5 (F.linear), oriented like nn.Linear.
        readers.append(Projection(layer.router, "weight", "linear"))
        owner, _, name = adapter.expert_in.rpartition(".")
        experts = layer.mlp.get_submodule(owner) if owner else layer.mlp
        if not isinstance(getattr(experts, name, None), torch.Tensor):
            raise _refuse(
                adapter,
                parallel,
                f"the MLP has no stacked expert weights at {adapter.expert_in!r} (this "
                f"transformers version may keep experts as separate modules)",
            )
        readers.append(Projection(experts, name, "experts"))
    return readers


def _plan(parts: ModelModules, adapter: ArchitectureAdapter, parallel: bool) -> _Plan:
    if adapter.description.moe and adapter.description.norm == "layernorm":
        raise _refuse(
            adapter,
            parallel,
            "a LayerNorm's bias would have to become a bias of every expert and the experts' "
            "output weights be centred, which is not implemented",
        )
    plan = _Plan(folds=[], writers=[], embeddings=[parts.embed], notes=[])
    if parts.pos_embed is not None:
        plan.embeddings.append(parts.pos_embed)
    for layer in parts.layers:
        attention = _attention_readers(layer, adapter)
        mlp = _mlp_readers(layer, adapter, parallel)
        if layer.ln2 is not None:
            if layer.ln1 is not None:
                plan.folds.append((layer.ln1, attention))
            plan.folds.append((layer.ln2, mlp))
        elif layer.ln1 is not None:
            plan.folds.append((layer.ln1, attention + mlp if parallel else attention))
        plan.writers.append(Projection(layer.o, "weight", adapter.linear))
        if layer.down is not None:
            plan.writers.append(Projection(layer.down, "weight", adapter.linear))
    # The unembedding is an nn.Linear in every family (GPT-2's blocks use Conv1D).
    if parts.final_norm is not None:
        plan.folds.append((parts.final_norm, [Projection(parts.lm_head, "weight", "linear")]))
    posts = [p for p in (adapter.ln1_post, adapter.ln2_post) if p]
    if posts:
        plan.notes.append(
            f"kept the sublayer-output norms {posts}: they normalise what attention and the "
            f"MLP write before it joins the residual stream, and nothing linear reads them"
        )
    if adapter.q_norm:
        plan.notes.append(
            f"kept the QK-norms {[adapter.q_norm, adapter.k_norm]}: they normalise queries "
            f"and keys after the projections, so their weights cannot move into them"
        )
    if parts.embed_norm is not None:
        plan.notes.append(
            f"kept the embedding norm {adapter.embed_norm!r}: it writes the residual stream's "
            f"first value, so the residual stream keeps that norm's mean"
        )
    return plan


# -- applying it ----------------------------------------------------------------------


def _softcap(hf_model: nn.Module, adapter: ArchitectureAdapter) -> float | None:
    if adapter.description.final_softcap is None:
        return None
    value = getattr(getattr(hf_model, "config", None), adapter.description.final_softcap, None)
    return float(value) if value else None


def enable_compatibility(
    hf_model: nn.Module,
    parts: ModelModules,
    adapter: ArchitectureAdapter,
    *,
    n_heads: int,
    n_kv_heads: int,
    d_head: int,
    parallel: bool,
    **options: Any,
) -> CompatState:
    """Rewrite ``hf_model``'s weights to HookedTransformer's processed-weights convention.

    Args:
        hf_model: The transformers model (changed in place).
        parts: Its resolved modules.
        adapter: The family's adapter.
        n_heads: Query heads.
        n_kv_heads: Key/value heads.
        d_head: Head size.
        parallel: Whether attention and the MLP read the same block input.
        **options: ``fold_ln``, ``center_writing_weights``, ``center_unembed``,
            ``fold_value_biases`` (each a bool, default ``True``).

    Returns:
        What was applied, with notes on what was kept or skipped.

    Raises:
        UserError: An unknown option or a non-bool value.
        UnsupportedFeatureError: A structure that cannot be folded (the message names the
            family's norms and what reads them), or an offloaded model.
    """
    opts = _parse(options)
    plan = _plan(parts, adapter, parallel)
    if any(p.is_meta for p in hf_model.parameters()):
        raise UnsupportedFeatureError(
            "enable_compatibility_mode() needs every weight in memory; this model is offloaded "
            "(device_map with disk/CPU offload) or was booted with load_weights=False. Boot it "
            "with device=... instead."
        )
    layer_norm = adapter.description.norm == "layernorm"
    center = opts["center_writing_weights"] and layer_norm
    notes = plan.notes if opts["fold_ln"] else []
    if opts["center_writing_weights"] and not layer_norm:
        notes.append(
            "skipped center_writing_weights: RMSNorm does not remove the mean, so centring "
            "the residual stream would change the model"
        )
    center_unembed = opts["center_unembed"]
    cap = _softcap(hf_model, adapter)
    if center_unembed and cap is not None:
        center_unembed = False
        message = (
            f"skipped center_unembed: the final logits are soft-capped "
            f"({adapter.description.final_softcap}={cap:g}), and tanh does not ignore a per-position shift"
        )
        notes.append(message)
        _LOG.warning("enable_compatibility_mode: %s", message)
    with torch.no_grad():
        if opts["fold_ln"] or center or center_unembed:
            untie(parts.lm_head, parts.embed)
        if opts["fold_ln"]:
            for norm, readers in plan.folds:
                # Folding into the readers is centring-safe only behind a LayerNorm.
                fold_norm(norm, readers, adapter, center=layer_norm)
        if center:
            for embedding in plan.embeddings:
                center_embedding(embedding)
            for writer in plan.writers:
                center_writer(writer)
        if center_unembed:
            center_unembedding(parts.lm_head)
        if opts["fold_value_biases"]:
            for layer in parts.layers:
                b_v = value_bias_view(layer.v, layer.qkv, adapter, n_heads, n_kv_heads, d_head)
                if b_v is not None:
                    o = Projection(layer.o, "weight", adapter.linear)
                    fold_value_bias(b_v, o, n_heads, n_kv_heads, d_head)
    return CompatState(
        fold_ln=opts["fold_ln"],
        center_writing_weights=center,
        center_unembed=center_unembed,
        fold_value_biases=opts["fold_value_biases"],
        notes=tuple(notes),
    )
