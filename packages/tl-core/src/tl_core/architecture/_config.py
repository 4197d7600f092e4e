"""``model_info_from_config``: the one reader of a transformers config's sizes.

Every driver that loads HuggingFace checkpoints (hf, vllm, ...) reads the sizes here, so the
same checkpoint reports the same ``ModelInfo`` on every driver; the structure comes from the
family's description (``FamilyDescription.model_info``). Duck-typed: tl-core does not import
transformers.
"""

from __future__ import annotations

from typing import Any, Literal

from tl_core._errors import ConfigError
from tl_core.hooks._model_info import ModelInfo

__all__ = ["first_set", "model_info_from_config"]

# Config field names of each size, in the order families use them.
_N_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_D_MODEL = ("hidden_size", "n_embd", "d_model")
_N_HEADS = ("num_attention_heads", "n_head", "num_heads")
_N_CTX = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
_D_MLP = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
_ROTARY_FRACTION = ("partial_rotary_factor", "rotary_pct")
_N_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k")
# The MLP activation's name; Gemma 2/3 call theirs hidden_activation (Gemma 1 hidden_act).
_ACT_FN = ("hidden_activation", "hidden_act", "activation_function", "activation")


def first_set(config: Any, names: tuple[str, ...]) -> Any:
    """The first of ``names`` the config sets (not ``None``), or ``None``."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def model_info_from_config(
    config: Any,
    *,
    normalization_type: Literal["LN", "RMS", "unknown"] | None,
    positional_embedding_type: Literal["standard", "rotary", "none", "unknown"],
    gated_mlp: bool,
    parallel_attn_mlp: bool = False,
    sandwich_norm: bool = False,
    post_residual_norm: bool = False,
    qk_norm: bool = False,
    embed_norm: bool = False,
    token_type_embed: bool = False,
    head_transform: bool = False,
    moe: bool = False,
    architecture: str | None = None,
    n_ctx: int | None = None,
    act_fn: str | None = None,
    device: str = "cpu",
) -> ModelInfo:
    """The ``ModelInfo`` of a transformers config (text config for multimodal wrappers).

    Args:
        config: A ``PretrainedConfig`` or anything with its attributes.
        normalization_type: The family's norm (``"LN"``, ``"RMS"``, ``None`` for none, or
            ``"unknown"`` where tl did not establish it).
        positional_embedding_type: ``"standard"`` (learned), ``"rotary"``, ``"none"`` or
            ``"unknown"``.
        gated_mlp: Whether the MLP has a gate projection.
        parallel_attn_mlp: Whether attention and MLP read the same block input.
        sandwich_norm: Whether each sublayer output is normalised.
        post_residual_norm: Whether each sublayer's residual sum is normalised (BERT).
        qk_norm: Whether queries and keys are normalised.
        embed_norm: Whether the embedding is normalised before the first block.
        token_type_embed: Whether a token-type (segment) embedding is added (BERT).
        head_transform: Whether a masked-LM head transform precedes the final norm (BERT).
        moe: Whether the MLP is a mixture of experts (expert counts come from the config).
        architecture: The class name to report (default: ``config.architectures[0]``).
        n_ctx: The longest input (default: the config's position limit, else 2048).
        act_fn: The MLP activation's name (default: the config's ``hidden_activation``,
            ``hidden_act``, ``activation_function`` or ``activation``, first one set;
            ``None`` when the config names none, as BLOOM's).
        device: Where the bridge takes token ids (see ``ModelInfo.device``).

    Returns:
        Sizes from the config, structure as given.

    Raises:
        ConfigError: The config lacks the layer count, width or head count.
    """
    n_layers = first_set(config, _N_LAYERS)
    d_model = first_set(config, _D_MODEL)
    n_heads = first_set(config, _N_HEADS)
    name = architecture or str((getattr(config, "architectures", None) or ["<unknown>"])[0])
    if n_layers is None or d_model is None or n_heads is None:
        raise ConfigError(
            f"the config of {name!r} lacks the layer count, width or head count (one of "
            f"{_N_LAYERS}, {_D_MODEL}, {_N_HEADS}); is this a complete config.json of a "
            f"causal language model?"
        )
    head_dim = getattr(config, "head_dim", None)
    d_head = int(head_dim) if head_dim else int(d_model) // int(n_heads)
    n_kv = first_set(config, ("num_key_value_heads", "num_kv_heads"))
    if getattr(config, "multi_query", None) is True and not getattr(
        config, "new_decoder_architecture", False
    ):
        # GPT-BigCode, Falcon-7B: multi-query attention has one key/value head, whatever
        # count the config also carries (transformers ignores it).
        n_kv = 1
    d_mlp = first_set(config, _D_MLP)
    limit = n_ctx if n_ctx is not None else first_set(config, _N_CTX)
    rotary_dim = None
    # transformers 5 keeps rotary settings in ``rope_parameters``; older configs at the top.
    rope = getattr(config, "rope_parameters", None)
    rope = rope if isinstance(rope, dict) else {}
    fraction = next((rope[k] for k in _ROTARY_FRACTION if rope.get(k) is not None), None)
    fraction = fraction if fraction is not None else first_set(config, _ROTARY_FRACTION)
    if positional_embedding_type == "rotary" and fraction is not None and float(fraction) < 1.0:
        rotary_dim = int(d_head * float(fraction))
    explicit = getattr(config, "rotary_dim", None)
    if positional_embedding_type == "rotary" and isinstance(explicit, int) and explicit < d_head:
        rotary_dim = explicit
    if act_fn is None:
        named = first_set(config, _ACT_FN)
        act_fn = named if isinstance(named, str) else None
    return ModelInfo(
        n_layers=int(n_layers),
        d_model=int(d_model),
        n_heads=int(n_heads),
        d_head=d_head,
        d_mlp=int(d_mlp) if d_mlp else 4 * int(d_model),
        d_vocab=int(config.vocab_size),
        n_ctx=int(limit) if limit else 2048,
        n_key_value_heads=int(n_kv) if n_kv else None,
        normalization_type=normalization_type,
        positional_embedding_type=positional_embedding_type,
        gated_mlp=gated_mlp,
        parallel_attn_mlp=parallel_attn_mlp,
        sandwich_norm=sandwich_norm,
        post_residual_norm=post_residual_norm,
        qk_norm=qk_norm,
        embed_norm=embed_norm,
        token_type_embed=token_type_embed,
        head_transform=head_transform,
        n_experts=_int_or_none(first_set(config, _N_EXPERTS)) if moe else None,
        experts_per_token=_int_or_none(first_set(config, _TOP_K)) if moe else None,
        rotary_dim=rotary_dim,
        d_q_latent=_int_or_none(getattr(config, "q_lora_rank", None)),
        d_kv_latent=_int_or_none(getattr(config, "kv_lora_rank", None)),
        act_fn=act_fn,
        architecture=name,
        device=device,
    )
