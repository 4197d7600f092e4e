"""HookedTransformer's processed-weights convention, applied to a loaded transformers model.

``enable_compatibility`` rewrites the wrapped model's parameters in place so that its
activations follow TransformerLens' ``fold_ln`` / ``center_writing_weights`` /
``center_unembed`` / ``fold_value_biases`` processing:

- **fold_ln**: each norm's weight (and bias) moves into the linear layers that read the
  norm's output (q/k/v, MLP input/gate/up, the unembedding); the norm's own weight becomes
  the identity (``1``, or ``0`` under Gemma's ``(1 + w)`` rule) and its bias ``0``. On
  LayerNorm models the folded reading weights are also centred over ``d_model`` (exact:
  a LayerNorm's normalized value has zero mean).
- **center_writing_weights** (LayerNorm models only; RMSNorm does not remove the mean, so
  centring would change the model): everything written to the residual stream (token and
  position embeddings, attention and MLP output weights and biases) loses its mean over
  ``d_model``, so the residual stream has zero mean at every position.
- **center_unembed**: the unembedding (and its bias) loses its mean over the vocabulary;
  logits shift by a per-position constant, which ``softmax`` ignores.
- **fold_value_biases**: value biases move into the attention output bias
  (``b_O += sum_h b_V[h] @ W_O[h]``), exact because each attention row sums to one.

Only models the driver loaded itself are rewritten; a user's ``hf_model`` is never
mutated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from tl_core import UnsupportedFeatureError, UserError
from tl_driver_hf._modules import LayerModules, ModelModules
from tl_driver_hf.adapters import ArchitectureAdapter, LinearKind

__all__ = ["CompatState", "enable_compatibility"]

_OPTIONS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")


@dataclass(frozen=True)
class CompatState:
    """What compatibility mode did to the weights.

    Attributes:
        fold_ln: Norm weights (and biases) were folded into the layers reading them.
        center_writing_weights: Residual-stream writers were centred over ``d_model``
            (``False`` on RMSNorm models even when requested: centring would change them).
        center_unembed: The unembedding was centred over the vocabulary.
        fold_value_biases: Value biases were folded into the attention output bias.
    """

    fold_ln: bool
    center_writing_weights: bool
    center_unembed: bool
    fold_value_biases: bool


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


#: Families whose fold is verified by tests/test_compat.py; others are refused rather than
#: folded on trust (fused per-head qkv, ALiBi, embedding norms and position offsets each
#: need their own checked fold).
_VERIFIED_FAMILIES = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "stablelm"})


def _check_family(adapter: ArchitectureAdapter) -> None:
    reason = None
    if adapter.moe:
        reason = "its MLP is a mixture of experts (the norm would have to be folded into every expert and the router)"
    elif adapter.sandwich:
        reason = "it normalises sublayer outputs before they join the residual stream (sandwich norms), which cannot be folded"
    elif adapter.parallel:
        reason = "attention and MLP read one shared norm in parallel blocks, which this fold does not handle"
    elif adapter.ln1 is None or adapter.ln2 is None:
        reason = "its blocks have no pre-norm to fold"
    elif adapter.family not in _VERIFIED_FAMILIES:
        reason = "its fold has not been verified against an independent computation yet"
    if reason is not None:
        raise UnsupportedFeatureError(
            f"enable_compatibility_mode() is not implemented for the {adapter.family!r} family: "
            f"{reason}. Supported: pre-norm sequential families (gpt2, llama, mistral, qwen2, "
            f"qwen3, gemma, phi3, stablelm). Use the bridge without compatibility mode."
        )


# -- parameter access in [in, out] layout ---------------------------------------------


def _read(module: nn.Module, kind: LinearKind) -> torch.Tensor:
    weight = cast(torch.Tensor, module.weight)
    w = weight if kind == "conv1d" else weight.T
    return w.detach().double()


def _write(module: nn.Module, kind: LinearKind, w: torch.Tensor) -> None:
    weight = cast(torch.Tensor, module.weight)
    weight.data.copy_(w if kind == "conv1d" else w.T)


def _bias(module: nn.Module, size: int, like: torch.Tensor) -> torch.Tensor:
    """The module's bias (added as a zero parameter first when it has none)."""
    bias = getattr(module, "bias", None)
    if not isinstance(bias, torch.Tensor):
        bias = nn.Parameter(
            torch.zeros(size, dtype=like.dtype, device=like.device),
            requires_grad=like.requires_grad,
        )
        module.bias = bias
    return bias


def _add_to_bias(module: nn.Module, delta: torch.Tensor, like: torch.Tensor) -> None:
    bias = _bias(module, delta.shape[0], like)
    bias.data.copy_(bias.detach().double() + delta)


# -- the four transformations ---------------------------------------------------------


def _effective_weight(
    norm: nn.Module, adapter: ArchitectureAdapter, size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        w = weight.detach().double()
        if adapter.norm == "rms_plus_one":
            w = w + 1.0
    else:
        w = torch.ones(size, dtype=torch.float64)
    bias = getattr(norm, "bias", None)
    b = bias.detach().double() if isinstance(bias, torch.Tensor) else None
    return w, b


def _make_identity(norm: nn.Module, adapter: ArchitectureAdapter) -> None:
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        weight.data.fill_(0.0 if adapter.norm == "rms_plus_one" else 1.0)
    bias = getattr(norm, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.data.zero_()


def _fold_norm(
    norm: nn.Module,
    readers: list[nn.Module],
    kind: LinearKind,
    adapter: ArchitectureAdapter,
    center: bool,
) -> None:
    """Fold ``norm``'s weight and bias into every module reading its output."""
    size = int(cast(torch.Tensor, readers[0].weight).shape[0 if kind == "conv1d" else 1])
    w, b = _effective_weight(norm, adapter, size)
    for reader in readers:
        weight = cast(torch.Tensor, reader.weight)
        W = _read(reader, kind)
        w_ = w.to(W.device)
        if b is not None:
            _add_to_bias(reader, b.to(W.device) @ W, weight)
        W = w_[:, None] * W
        if center:
            W = W - W.mean(dim=0, keepdim=True)
        _write(reader, kind, W)
    _make_identity(norm, adapter)


def _readers(layer: LayerModules, which: str) -> list[nn.Module]:
    if which == "ln1":
        found = [layer.qkv] if layer.qkv is not None else [layer.q, layer.k, layer.v]
    elif layer.gate_up is not None:
        found = [layer.gate_up]
    else:
        found = [layer.mlp_in, layer.gate, layer.up]
    return [m for m in found if m is not None]


def _center_writer(module: nn.Module, kind: LinearKind) -> None:
    W = _read(module, kind)
    _write(module, kind, W - W.mean(dim=1, keepdim=True))
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        b = bias.detach().double()
        bias.data.copy_(b - b.mean())


def _center_embedding(module: nn.Module) -> None:
    weight = cast(torch.Tensor, module.weight)
    w = weight.detach().double()
    weight.data.copy_(w - w.mean(dim=-1, keepdim=True))


def _fold_value_bias(
    layer: LayerModules, adapter: ArchitectureAdapter, n_heads: int, n_kv: int, d_head: int
) -> None:
    if layer.qkv is not None:
        bias = getattr(layer.qkv, "bias", None)
        start = (n_heads + n_kv) * d_head
        b_v = bias[start:] if isinstance(bias, torch.Tensor) else None
    else:
        assert layer.v is not None
        bias = getattr(layer.v, "bias", None)
        b_v = bias if isinstance(bias, torch.Tensor) else None
    if b_v is None:
        return
    per_kv = b_v.detach().double().reshape(n_kv, d_head)
    per_head = per_kv.repeat_interleave(n_heads // n_kv, dim=0)
    W_O = _read(layer.o, adapter.linear).reshape(n_heads, d_head, -1)
    delta = torch.einsum("he,hed->d", per_head.to(W_O.device), W_O)
    _add_to_bias(layer.o, delta, cast(torch.Tensor, layer.o.weight))
    b_v.data.zero_()


def _untie_head(parts: ModelModules) -> None:
    """Give the unembedding its own weight when it shares the embedding's."""
    head = cast(torch.Tensor, parts.lm_head.weight)
    embed = cast(torch.Tensor, parts.embed.weight)
    if head is embed or head.data_ptr() == embed.data_ptr():
        parts.lm_head.weight = nn.Parameter(head.detach().clone(), requires_grad=head.requires_grad)


def enable_compatibility(
    hf_model: nn.Module,
    parts: ModelModules,
    adapter: ArchitectureAdapter,
    *,
    n_heads: int,
    n_kv_heads: int,
    d_head: int,
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
        **options: ``fold_ln``, ``center_writing_weights``, ``center_unembed``,
            ``fold_value_biases`` (each a bool, default ``True``).

    Returns:
        What was applied.

    Raises:
        UserError: An unknown option or a non-bool value.
        UnsupportedFeatureError: The family's structure cannot be folded (names it), or
            the model is offloaded (weights not in memory).
    """
    opts = _parse(options)
    _check_family(adapter)
    if any(p.is_meta for p in hf_model.parameters()):
        raise UnsupportedFeatureError(
            "enable_compatibility_mode() needs every weight in memory; this model is offloaded "
            "(device_map with disk/CPU offload) or was booted with load_weights=False. Boot it "
            "with device=... instead."
        )
    layer_norm = adapter.norm == "layernorm"
    center = opts["center_writing_weights"] and layer_norm
    with torch.no_grad():
        if opts["fold_ln"] or center or opts["center_unembed"]:
            _untie_head(parts)
        if opts["fold_ln"]:
            for layer in parts.layers:
                assert layer.ln1 is not None and layer.ln2 is not None
                _fold_norm(layer.ln1, _readers(layer, "ln1"), adapter.linear, adapter, center)
                _fold_norm(layer.ln2, _readers(layer, "ln2"), adapter.linear, adapter, center)
            # The unembedding is an nn.Linear in every family (GPT-2's blocks use Conv1D).
            _fold_norm(parts.final_norm, [parts.lm_head], "linear", adapter, center)
        if center:
            _center_embedding(parts.embed)
            if parts.pos_embed is not None:
                _center_embedding(parts.pos_embed)
            for layer in parts.layers:
                _center_writer(layer.o, adapter.linear)
                assert layer.down is not None
                _center_writer(layer.down, adapter.linear)
        if opts["center_unembed"]:
            head = parts.lm_head
            W_U = _read(head, "linear")
            _write(head, "linear", W_U - W_U.mean(dim=1, keepdim=True))
            bias = getattr(head, "bias", None)
            if isinstance(bias, torch.Tensor):
                b = bias.detach().double()
                bias.data.copy_(b - b.mean())
        if opts["fold_value_biases"]:
            for layer in parts.layers:
                _fold_value_bias(layer, adapter, n_heads, n_kv_heads, d_head)
    return CompatState(
        fold_ln=opts["fold_ln"],
        center_writing_weights=center,
        center_unembed=opts["center_unembed"],
        fold_value_biases=opts["fold_value_biases"],
    )
