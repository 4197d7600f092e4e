"""Tiny random configs of every model type the architecture report scans.

``tiny_config(model_type)`` shrinks transformers' default config of a model type to two
layers of width 64 by rules over the config's fields, not by a table of model types: every
alias of the hidden width, layer and head counts, the MLP, mixture-of-experts, multi-head
latent attention, state-space and linear-attention sizes, vocabulary (special ids moved
under it), per-layer lists (cut to layer 0 and the first layer unlike it, so a hybrid
keeps both kinds), sub-configs of multimodal wrappers, and sizes the default config leaves
unset. A few types need one more field, in ``OVERRIDES``.

Used by ``scripts/_tiny_builds.py`` (which builds, runs and caches the checkpoints) and
``scripts/architecture_report.py``.
"""

from __future__ import annotations

import contextlib
import signal
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeGuard

__all__ = [
    "BATCH_SHAPE",
    "OVERRIDES",
    "VOCAB",
    "TimeLimitError",
    "decoder_layers",
    "describe",
    "input_ids",
    "perturb_constants",
    "quiet",
    "run_transformers",
    "time_limit",
    "tiny_config",
]

WIDTH = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
FFN = 128
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
EXPERT_FFN = 32
VOCAB = 512
#: The token batch every type runs on: two prompts of seven ids.
BATCH_SHAPE = (2, 7)

# -- the rules ----------------------------------------------------------------------------
#
# Each rule maps a config field (its real name, as in ``to_dict()``) to a function of its
# default value that returns the tiny value (``_KEEP`` leaves it). ``_shrink`` applies them
# in three stages: the primary fields first; the config class then derives what it derives
# from them (a default head_dim from width / heads, qk_head_dim from the latent sizes), and a
# later stage's rule applies only to a field that is still at its default value.

_KEEP = object()


def _to(value: int) -> Callable[[Any], Any]:
    """The tiny size ``value`` for an integer field; ``None`` and other types stay."""
    return lambda old: value if isinstance(old, int) and not isinstance(old, bool) else _KEEP


def _at_most(value: int) -> Callable[[Any], Any]:
    return lambda old: (
        min(old, value) if isinstance(old, int) and not isinstance(old, bool) else _KEEP
    )


def _kernel_at_most(value: int) -> Callable[[Any], Any]:
    """At most ``value``, keeping an odd kernel odd (a "same"-padded convolution of an even
    kernel changes the sequence length)."""

    def rule(old: Any) -> Any:
        if not isinstance(old, int) or isinstance(old, bool):
            return _KEEP
        return min(old, value if old % 2 == value % 2 else value - 1)

    return rule


def _names(*names: str, rule: Callable[[Any], Any]) -> dict[str, Callable[[Any], Any]]:
    return dict.fromkeys(names, rule)


_PRIMARY: dict[str, Callable[[Any], Any]] = {
    **_names(
        "hidden_size",
        "n_embd",
        "d_model",
        "dim",
        "embed_dim",
        "emb_dim",
        "model_dim",
        "hidden_dim",
        "embedding_size",
        "word_embed_proj_dim",
        "input_embedding_size",
        "output_embedding_size",
        "lru_width",
        "embedding_dim",
        "backbone_hidden_size",
        rule=_to(WIDTH),
    ),
    **_names(
        "num_hidden_layers",
        "n_layer",
        "n_layers",
        "num_layers",
        "decoder_layers",
        "encoder_layers",
        "num_decoder_layers",
        "num_encoder_layers",
        "depth",
        rule=_to(LAYERS),
    ),
    **_names(
        "num_attention_heads",
        "n_head",
        "n_heads",
        "num_heads",
        "decoder_attention_heads",
        "encoder_attention_heads",
        "attention_heads",
        "num_decoder_attention_heads",
        "num_encoder_attention_heads",
        "swa_num_attention_heads",
        "num_attention_heads_per_layer",
        rule=_to(HEADS),
    ),
}

_SECONDARY: dict[str, Callable[[Any], Any]] = {
    **_names(
        "intermediate_size",
        "n_inner",
        "ffn_dim",
        "ffn_hidden_size",
        "decoder_ffn_dim",
        "encoder_ffn_dim",
        "feed_forward_size",
        "dim_ff",
        "dff",
        "intermediate_size_mlp",
        "dense_intermediate_size",
        "d_ff",
        "d_inner",
        rule=_to(FFN),
    ),
    **_names(
        "moe_intermediate_size",
        "expert_ffn_hidden_size",
        "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "shared_intermediate_size",
        "shared_experts_intermediate_size",
        rule=_to(EXPERT_FFN),
    ),
    **_names(
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "moe_num_experts",
        rule=_at_most(EXPERTS),
    ),
    **_names(
        "num_experts_per_tok",
        "num_experts_per_token",
        "moe_topk",
        "moe_k",
        rule=_at_most(EXPERTS_PER_TOKEN),
    ),
    # Grouped routing (DeepSeek): one group holding every expert.
    **_names("n_group", "num_expert_group", "topk_group", rule=_at_most(1)),
    **_names("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", rule=_at_most(1)),
    "zero_expert_num": _at_most(EXPERTS),
    # One dense layer before the sparse ones: both kinds are built.
    **_names(
        "first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", rule=_at_most(1)
    ),
    # Multi-head latent attention: rope + nope = the tiny head_dim.
    **_names("q_lora_rank", "kv_lora_rank", "o_lora_rank", rule=_to(32)),
    **_names("qk_rope_head_dim", "qk_nope_head_dim", rule=_to(HEAD_DIM // 2)),
    **_names("v_head_dim", "index_head_dim", rule=_to(HEAD_DIM)),
    "index_n_heads": _to(HEADS),
    # State-space mixers: inner width expand * 64 = 128, in heads of 16.
    **_names("state_size", "mamba_d_state", "ssm_state_size", "d_state", rule=_to(16)),
    **_names("expand", "mamba_expand", rule=_to(2)),
    **_names(
        "conv_kernel",
        "mamba_d_conv",
        "conv_kernel_size",
        "linear_conv_kernel_dim",
        "d_conv",
        "conv1d_width",
        "short_conv_kernel_size",
        rule=_kernel_at_most(4),
    ),
    **_names("n_groups", "mamba_n_groups", "mamba_ngroups", rule=_to(1)),
    **_names("mamba_d_head", "mamba_head_dim", "mamba_headdim", rule=_to(HEAD_DIM)),
    **_names("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", rule=_to(2 * WIDTH // HEAD_DIM)),
    **_names("time_step_rank", "mamba_dt_rank", rule=_to(8)),
    # Linear attention (gated delta net and kin).
    **_names("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", rule=_to(HEAD_DIM)),
    "linear_num_key_heads": _to(KV_HEADS),
    **_names("linear_num_value_heads", "linear_num_heads", rule=_to(HEADS)),
    **_names("swa_num_key_value_heads", rule=_to(KV_HEADS)),
    # Per-layer token embeddings, low-rank side paths, adapters.
    **_names("hidden_size_per_layer_input", "laurel_rank", "adapter_rank", rule=_to(16)),
    "pretraining_tp": _at_most(1),
    # Gemma 3n shares the KV of its last layers; two layers share none.
    "num_kv_shared_layers": _at_most(0),
    # Layer patterns by period: period 2, so both kinds of layer are built.
    **_names("attn_layer_period", "expert_layer_period", "layer_group_size", rule=_at_most(2)),
    # Vision and audio towers: stage widths and depths of hierarchical encoders (ResNet,
    # ConvNeXt, Swin), latent arrays (Perceiver), codebooks, projector and filter widths.
    **_names(
        "hidden_sizes",
        "embed_dims",
        "hidden_dims",
        "neck_hidden_sizes",
        "d_latents",
        "projection_dim",
        "image_token_embed_dim",
        "out_hidden_size",
        "projector_hidden_size",
        "vision_output_dim",
        "projector_input_dim",
        "projector_output_dim",
        "latent_channels",
        rule=_at_most(WIDTH),
    ),
    "alignment_intermediate_size": _at_most(FFN),
    # A VQ image tokenizer's convolutions (GroupNorm of 32 groups: a multiple of 32).
    "base_channels": _at_most(32),
    "moe_hidden_size": _at_most(FFN),
    **_names("depths", "num_self_attends_per_block", rule=_at_most(LAYERS)),
    "num_latents": _at_most(32),
    "num_filters": _at_most(8),
    "num_embeddings": _at_most(VOCAB),
    # A window shorter than the 7-token batch, so that sliding-window masks matter.
    **_names("sliding_window", "sliding_window_size", "attention_window_size", rule=_at_most(4)),
}

#: Sizes a config class often derives from others: set last, and only when not derived.
_LATE: dict[str, Callable[[Any], Any]] = {
    **_names(
        "head_dim",
        "d_head",
        "attention_head_dim",
        "kv_channels",
        "dim_head",
        "attention_head_size",
        "swa_head_dim",
        "qk_head_dim",
        rule=_to(HEAD_DIM),
    ),
    "mamba_d_ssm": _to(2 * WIDTH),
    "attention_hidden_size": _to(2 * WIDTH),
}

#: (SSM head count, SSM head width, expansion) field triples.
_SSM_HEADS = (
    ("num_heads", "head_dim", "expand"),
    ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("mamba_num_heads", "mamba_head_dim", "expand"),
    ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
)

#: Key/value head counts keep their kind: multi-query stays 1, full multi-head stays
#: equal to the head count, grouped becomes 2.
_KV_HEAD_FIELDS = (
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "multi_query_group_num",
    "num_query_groups",
    "n_head_kv",
)
_HEAD_FIELDS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_OFFSET_FIELDS = {
    "attn_layer_offset": "attn_layer_period",
    "expert_layer_offset": "expert_layer_period",
}
_ROTARY_FIELDS = ("rotary_dim",)
_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")

#: What a rule over fields cannot decide, per model type: fields set after the rules.
#: Keyed by the model type of the config or sub-config they apply to.
OVERRIDES: dict[str, dict[str, Any]] = {
    # Reformer's axial position embeddings split the width in two.
    "reformer": {"axial_pos_embds_dim": [32, 32]},
    # Zamba ties the weights of its shared attention block across hybrid layers and
    # refuses a model with only one: two hybrid layers (each holds a Mamba mixer too).
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},
    # The default is EfficientNet-B7 (2x wider, 3.1x deeper than B0), whose head width
    # the width rule would cut below its last block's: B0's sizes.
    "efficientnet": {"width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 1280},
    # The default config leaves the layer pattern unset; the checkpoints mix both.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # The full-attention layer kept by the layer rule needs its token indexer's sizes,
    # which the default config leaves unset.
    "qwen4_exp_text": {
        "indexer_n_heads": HEADS,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
    },
}

#: Flags that make a model built for causal LM causal (BERT-like classes default to an
#: encoder's bidirectional attention; XLM has its own flag).
_CAUSAL = {"is_decoder": True, "causal": True}

#: Sizes a default config leaves unset (``None``) although the model needs them.
_FILL: dict[str, int] = {
    # A CTC head over the default config of a speech encoder (Wav2Vec2-BERT, -Conformer).
    "vocab_size": VOCAB,
    "num_experts_per_tok": EXPERTS_PER_TOKEN,
    "n_routed_experts": EXPERTS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "n_shared_experts": 1,
}

#: Name parts of fields that may repeat another config's width (an adapter's input and
#: output, a cross-attention's global width), and of those that never do.
_WIDTH_LIKE = ("dim", "size", "hidden")
_NOT_WIDTH = (
    "vocab",
    "position",
    "window",
    "chunk",
    "patch",
    "image",
    "batch",
    "kernel",
    "group",
    "sample",
    "feature",
    "hop",
    "merge",
    "block",
    "rank",
    "head",
    "expert",
    "intermediate",
    "layer",
    "state",
    "conv",
    "bucket",
    "budget",
)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_count(d: Mapping[str, Any]) -> int | None:
    for field in _LAYER_COUNT_FIELDS:
        if _is_int(d.get(field)) and d[field] > 0:
            return int(d[field])
    return None


def _head_count(d: Mapping[str, Any]) -> int | None:
    return next((int(d[f]) for f in _HEAD_FIELDS if _is_int(d.get(f)) and d[f] > 0), None)


def _is_index_list(value: Any, n_layers: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) < n_layers
        and all(_is_int(v) and 0 <= v < n_layers for v in value)
        and len(set(value)) == len(value)
    )


def _layer_lists(d: Mapping[str, Any], n_layers: int) -> tuple[list[str], list[str]]:
    """Fields holding one entry per layer, and fields holding a list of layer indices."""
    per_layer = [
        k for k, v in d.items() if isinstance(v, list) and len(v) == n_layers and n_layers > LAYERS
    ]
    indices = [
        k
        for k, v in d.items()
        if k not in per_layer and n_layers > LAYERS and _is_index_list(v, n_layers)
    ]
    return per_layer, indices


def _chosen_layers(
    d: Mapping[str, Any], n_layers: int, per_layer: list[str], indices: list[str]
) -> list[int]:
    """Layer 0 and the first layer unlike it (another kind of mixer, MLP or attention), so
    that a hybrid model keeps both kinds in two layers."""

    def signature(i: int) -> tuple[Any, ...]:
        return tuple(repr(d[k][i]) for k in per_layer) + tuple(i in d[k] for k in indices)

    other = next((i for i in range(1, n_layers) if signature(i) != signature(0)), 1)
    return [0, other]


def _tiny_value(field: str, old: Any, rules: Mapping[str, Callable[[Any], Any]]) -> Any:
    rule = rules.get(field)
    if rule is None:
        return _KEEP
    if isinstance(old, list) and old and all(_is_int(v) for v in old):
        new = [rule(v) for v in old]
        return _KEEP if any(v is _KEEP for v in new) else new
    return rule(old)


def _special_ids(d: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in d.items()
        if isinstance(k, str)
        and k.endswith(("_token_id", "_token_ids", "_token_index", "_idx_token"))
        and (_is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)))
    }


def _vocab_overrides(d: Mapping[str, Any]) -> dict[str, Any]:
    """Vocabulary sizes capped at ``VOCAB``; special token ids past the cap moved under it
    (each distinct id to its own slot counted down from the top)."""
    out: dict[str, Any] = {}
    vocab_fields = [
        k
        for k, v in d.items()
        if isinstance(k, str) and "vocab" in k and k != "type_vocab_size" and _is_int(v)
    ]
    for k in vocab_fields:
        if d[k] > VOCAB:
            out[k] = VOCAB
    if not out:
        return out
    moved: dict[int, int] = {}

    def under(value: int) -> int:
        if value < VOCAB or value < 0:
            return value
        return moved.setdefault(value, VOCAB - 1 - len(moved))

    for k, v in sorted(_special_ids(d).items()):
        new = under(v) if _is_int(v) else [under(x) for x in v]
        if new != v:
            out[k] = new
    return out


def _overrides(d: Mapping[str, Any], rules: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field, old in d.items():
        new = _tiny_value(field, old, rules)
        if new is not _KEEP and new != old:
            out[field] = new
    return out


def _layer_rules(default: Mapping[str, Any]) -> dict[str, Any]:
    """Per-layer lists cut to the two chosen layers, layer-index lists renumbered."""
    out: dict[str, Any] = {}
    n_layers = _layer_count(default)
    if not n_layers:
        return out
    per_layer, indices = _layer_lists(default, n_layers)
    chosen = _chosen_layers(default, n_layers, per_layer, indices)
    for field in per_layer:
        values = [default[field][i] for i in chosen]
        tiny = _tiny_value(field, values, {**_PRIMARY, **_SECONDARY, **_LATE})
        out[field] = values if tiny is _KEEP else tiny
    for field in indices:
        out[field] = [new for new, old in enumerate(chosen) if old in default[field]]
    for field, value in default.items():
        by_layer = _layer_keyed(value, n_layers)
        if by_layer is not None:
            out[field] = {
                new: _tiny_layer_fields(by_layer[old], default)
                for new, old in enumerate(chosen)
                if old in by_layer
            }
    return out


def _layer_keyed(value: Any, n_layers: int) -> dict[int, Any] | None:
    """A heterogeneous model's per-layer fields (``{"05": {"head_dim": 512}}``) by layer."""
    if not isinstance(value, dict) or not value or n_layers <= LAYERS:
        return None
    keys = [str(k) for k in value]
    if not all(k.isdigit() and int(k) < n_layers for k in keys):
        return None
    return {int(k): v for k, v in value.items()}


def _tiny_layer_fields(fields: Any, default: Mapping[str, Any]) -> Any:
    """One layer's own fields, shrunk by the same rules as the config's."""
    if not isinstance(fields, dict):
        return fields
    rules = {**_PRIMARY, **_SECONDARY, **_LATE}
    out = {**fields, **_overrides(fields, rules)}
    heads = fields.get("num_attention_heads", _head_count(default))
    for field in _KV_HEAD_FIELDS:
        if _is_int(fields.get(field)) and fields[field] > 0:
            out[field] = 1 if fields[field] == 1 else HEADS if fields[field] == heads else KV_HEADS
    return out


def _width(d: Mapping[str, Any]) -> int | None:
    return next(
        (int(d[f]) for f in ("hidden_size", "n_embd", "d_model") if _is_int(d.get(f))), None
    )


def _field_rules(
    default: Mapping[str, Any], current: Mapping[str, Any], stage: int
) -> dict[str, Any]:
    """Rules over several fields at once, by stage (see ``_shrink``)."""
    out: dict[str, Any] = {}
    if stage == 1:
        heads = _head_count(default)
        for field in _KV_HEAD_FIELDS:
            old = default.get(field)
            if _is_int(old) and old > 0:
                out[field] = 1 if old == 1 else HEADS if old == heads else KV_HEADS
        for offset, period in _OFFSET_FIELDS.items():
            if (
                _is_int(default.get(offset))
                and _is_int(default.get(period))
                and default[period] > 2
            ):
                out[offset] = default[offset] % 2
    if stage == 2:
        for field, value in _FILL.items():
            if field in default and default[field] is None and current.get(field) is None:
                out[field] = value
        # Multi-head latent attention whose head_dim is the rotary part stays so.
        rope = "qk_rope_head_dim"
        if (
            _is_int(default.get(rope))
            and default.get("head_dim") == default[rope]
            and current.get("head_dim") != current.get(rope)
        ):
            out["head_dim"] = current[rope]
        heads, width = _head_count(default), _width(default)
        old_head_dim = default.get("head_dim") if _is_int(default.get("head_dim")) else None
        if old_head_dim is None and heads and width:
            old_head_dim = width // heads
        new_head_dim = current.get("head_dim") if _is_int(current.get("head_dim")) else HEAD_DIM
        for field in _ROTARY_FIELDS:
            old = default.get(field)
            if _is_int(old) and old > 0 and old_head_dim:
                out[field] = max(2, 2 * round(old / old_head_dim * new_head_dim / 2))
        # A state-space mixer's heads tile its inner width (expand * hidden).
        for n_field, dim_field, expand_field in _SSM_HEADS:
            n, dim, expand = (default.get(f) for f in (n_field, dim_field, expand_field))
            if (
                _is_int(n)
                and _is_int(dim)
                and _is_int(expand)
                and width
                and n * dim == expand * width
            ):
                new_dim = current.get(dim_field)
                new_expand = current.get(expand_field)
                if _is_int(new_dim) and _is_int(new_expand) and new_dim > 0:
                    out[n_field] = new_expand * WIDTH // new_dim
    return out


def _widths(config: Any, found: dict[int, int] | None = None) -> dict[int, int]:
    """Default width -> tiny width of every config in the tree (``{5120: 64, 1536: 64}``)."""
    found = {} if found is None else found
    d = config.to_dict()
    for field, rule in _PRIMARY.items():
        if rule is _PRIMARY["hidden_size"] and _is_int(d.get(field)) and d[field] > WIDTH:
            found[int(d[field])] = WIDTH
    for key in getattr(type(config), "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _widths(sub, found)
    return found


def _width_aliases(still: Mapping[str, Any], widths: Mapping[int, int]) -> dict[str, Any]:
    """Fields left at a default that is some config's width, named like a width: that
    config's tiny width (a vision adapter's output is the text model's width)."""
    return {
        field: widths[value]
        for field, value in still.items()
        if isinstance(field, str)
        and _is_int(value)
        and value in widths
        and any(part in field for part in _WIDTH_LIKE)
        and not any(part in field for part in _NOT_WIDTH)
    }


#: Bookkeeping fields of ``to_dict()`` that are no constructor arguments.
_BOOKKEEPING = ("model_type", "transformers_version", "_name_or_path", "architectures")


def _sub_maker(sub: Any) -> Callable[..., Any]:
    """Builds ``sub``'s class from the fields in which the parent's default differs from the
    class's own (a vision-language wrapper's text model is not the text class's default)."""
    cls = type(sub)
    base = {k: v for k, v in sub.to_diff_dict().items() if k not in _BOOKKEEPING}
    return lambda **fields: cls(**{**base, **fields})


def _shrink(
    make: Callable[..., Any],
    default: Any,
    widths: Mapping[int, int] | None = None,
    *,
    causal: bool = True,
) -> Any:
    """The tiny version of ``default`` (a ``PretrainedConfig``), built by ``make(**fields)``;
    with ``causal``, BERT-like configs are made decoders (``_CAUSAL``).

    Three stages, each building the config anew from the fields set so far: the primary
    sizes (and sub-configs, vocabulary), then the other sizes, then the sizes a config
    class often derives (head_dim, qk_head_dim, ...). A later stage sets only fields that
    are still at their default value, so what the config class derives from the fields
    already set (a head_dim of width / heads, or of qk_rope_head_dim) stays derived.
    """
    d = default.to_dict()
    widths = _widths(default) if widths is None else widths
    fields: dict[str, Any] = {}
    for key in getattr(type(default), "sub_configs", None) or {}:
        sub = getattr(default, key, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        fields[key] = _shrink(_sub_maker(sub), sub, widths, causal=causal)
    fields.update(_overrides(d, _PRIMARY))
    if causal:
        fields.update({k: v for k, v in _CAUSAL.items() if d.get(k) is False})
    fields.update(_vocab_overrides(d))
    fields.update(_layer_rules(d))
    for stage, rules in ((1, _SECONDARY), (2, _LATE)):
        # An intermediate stage may be inconsistent (hidden_size shrunk, head_dim not yet):
        # the config class's validators run on the last build only.
        with _unvalidated(type(default)):
            current = make(**fields).to_dict()
        still = {k: v for k, v in d.items() if k not in fields and current.get(k, _KEEP) == v}
        fields.update(_overrides(still, rules))
        if stage == 1:
            fields.update(
                _width_aliases({k: v for k, v in still.items() if k not in fields}, widths)
            )
        fields.update(_field_rules(d, {**current, **fields}, stage))
    fields.update(_mrope_section(type(default), make, fields))
    fields.update(OVERRIDES.get(d.get("model_type", ""), {}))
    return make(**fields)


def _mrope_section(
    cls: type, make: Callable[..., Any], fields: Mapping[str, Any]
) -> dict[str, Any]:
    """Multimodal rotary sections (Qwen2-VL, GLM-4V) that tile the tiny head's rotary half.

    A config class that lets ``rope_parameters`` carry ``mrope_section`` (its
    ``ignore_keys_at_rope_validation``) splits each head's rotary frequencies into
    temporal, height and width sections; the model's default ([16, 24, 24]) fits a 128-wide
    head only. The sections keep their proportions (1 : 1.5 : 1.5 where the config names none).
    """
    if "mrope_section" not in (getattr(cls, "ignore_keys_at_rope_validation", None) or ()):
        return {}
    with _unvalidated(cls):
        current = make(**fields).to_dict()
    rope = current.get("rope_parameters")
    head_dim = current.get("head_dim")
    if not _is_int(head_dim):
        width, heads = _width(current), _head_count(current)
        head_dim = width // heads if width and heads else None
    if not isinstance(rope, dict) or not head_dim:
        return {}
    factor = rope.get("partial_rotary_factor", current.get("partial_rotary_factor")) or 1.0
    half = int(head_dim * factor) // 2
    old = rope.get("mrope_section") or [16, 24, 24]
    if sum(old) == half:
        return {}
    section = [max(1, round(v * half / sum(old))) for v in old[:-1]]
    found = {"rope_parameters": {**rope, "mrope_section": [*section, half - sum(section)]}}
    try:  # a class that validates its rope parameters may refuse the key
        make(**{**fields, **found})
    except Exception:
        return {}
    return found


@contextlib.contextmanager
def _unvalidated(cls: type) -> Iterator[None]:
    """``cls(...)`` without its ``@strict`` class validators (``validate``)."""
    own = cls.__dict__.get("validate", _KEEP)
    cls.validate = lambda self: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if own is _KEEP:
            del cls.validate  # type: ignore[attr-defined]
        else:
            cls.validate = own  # type: ignore[attr-defined]


def tiny_config(model_type: str, *, causal: bool = True) -> Any:
    """transformers' default config of ``model_type``, shrunk to 2 layers of width 64.

    Args:
        model_type: The transformers model type.
        causal: Make BERT-like configs decoders (``is_decoder``), as their causal-LM
            classes need; ``False`` keeps an encoder's default attention.

    Raises:
        Exception: Whatever transformers raises for a config it cannot build.
    """
    from transformers import AutoConfig

    def make(**fields: Any) -> Any:
        return AutoConfig.for_model(model_type, **fields)

    with quiet():
        config = _shrink(make, make(), causal=causal)
    config.use_cache = False
    return config


# -- running --------------------------------------------------------------------------


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Without transformers' warnings, log lines and progress bars (the scan prints one line
    per type)."""
    from transformers.utils import logging as transformers_logging

    hf_logging: Any = transformers_logging  # its progress-bar switches are untyped
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


class TimeLimitError(Exception):
    """A model type ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeLimitError`` in the main thread after ``seconds`` (where SIGALRM exists)."""
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimeLimitError(f"ran past the {seconds:g} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _all_special_ids(config: Any) -> set[int]:
    found: set[int] = set()
    stack = [config.to_dict()]
    while stack:
        d = stack.pop()
        for v in _special_ids(d).values():
            found.update([v] if _is_int(v) else v)
        stack.extend(v for v in d.values() if isinstance(v, dict))
    return found


def _vocab_size(config: Any) -> int:
    for holder in (config, getattr(config, "text_config", None), getattr(config, "decoder", None)):
        size = getattr(holder, "vocab_size", None)
        if _is_int(size) and size > 0:
            return int(size)
    return VOCAB


def input_ids(config: Any, seed: int = 0) -> list[list[int]]:
    """A fixed batch of ``BATCH_SHAPE`` ids under the vocabulary, avoiding every special id
    (an image or audio placeholder id would send a multimodal model down another path)."""
    import torch

    vocab = min(_vocab_size(config), VOCAB)
    special = _all_special_ids(config)
    pool = [i for i in range(vocab) if i not in special]
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(pool), BATCH_SHAPE, generator=generator)
    return [[pool[int(j)] for j in row] for row in picks]


def decoder_layers(model: Any, ids: Any) -> Any:
    """The decoder's layer list, found without tl: of the model's ``nn.ModuleList``s as long
    as the config's layer count, the shallowest whose every child runs in a plain forward
    from ``ids`` (a vision tower's list of the same length does not run on text). ``None``
    when there is none."""
    from torch import nn

    config = model.config
    try:
        text = config.get_text_config()
    except (AttributeError, ValueError):  # several text configs (musicgen's encoder and decoder)
        text = getattr(config, "decoder", config)
    n_layers = _layer_count(text.to_dict()) or getattr(text, "num_hidden_layers", None)
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == n_layers
    ]
    ran: set[int] = set()
    handles = [
        child.register_forward_pre_hook(lambda module, args: ran.add(id(module)))
        for _, module in candidates
        for child in module
    ]
    try:
        run_transformers(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    running = [(name, module) for name, module in candidates if all(id(c) in ran for c in module)]
    running.sort(key=lambda item: item[0].count("."))
    return running[0][1] if running else None


def perturb_constants(model: Any, seed: int) -> None:
    """Add noise to parameters initialised constant (norm weights, biases): with all ones
    and zeros, "before or after the norm's weight" and "with or without bias" look alike."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if (
                param.is_floating_point()
                and param.numel() > 1
                and bool((param == param.flatten()[0]).all())
            ):
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)


def run_transformers(model: Any, ids: Any) -> Any:
    """``model``'s plain forward from token ids: no cache, every hidden state."""
    import torch

    with torch.no_grad():
        try:
            return model(input_ids=ids, use_cache=False, output_hidden_states=True)
        except TypeError as error:
            if "use_cache" not in str(error):
                raise
            return model(input_ids=ids, output_hidden_states=True)


def describe(error: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, at most ``limit`` characters."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
