"""When a model has the sites of a hook template: its ``requires`` conditions.

Each ``HookTemplate.requires`` names one structural condition; ``requirement_met`` decides
it from a ``ModelInfo`` and ``MISSING_BECAUSE`` says, for the sites a model lacks, why. A
site that needs a fact tl did not establish is not met either, and ``requirement_unknown``
names the fact (``UNKNOWN_BECAUSE`` says why): a norm's scale and pre-weight value where the
norms' weight rule is ``"unknown"`` (``ModelInfo.normalization_type``), the position sites
where the position scheme is. Such a site is neither served nor called structurally absent.
"""

from __future__ import annotations

from typing import Literal

from tl_core.hooks._model_info import ModelInfo

__all__ = [
    "MISSING_BECAUSE",
    "UNKNOWN_BECAUSE",
    "HookRequirement",
    "requirement_met",
    "requirement_unknown",
]

HookRequirement = Literal[
    "standard_pos",
    "rotary",
    "gated_mlp",
    "mlp_norm_input",
    "embed_norm",
    "token_types",
    "head_transform",
    "moe",
    "shared_expert",
    "q_latent",
    "kv_latent",
    "mixer",
    "sandwich_norm",
    "qk_norm",
    "attn_result",
    "split_qkv_input",
    "cross_attention",
    "norm",
]

#: Why a model lacks the sites of each requirement: "this model has no X: <reason>".
MISSING_BECAUSE: dict[HookRequirement, str] = {
    "standard_pos": "its positions are not learned embeddings (they enter through rotary "
    "q/k or not at all)",
    "rotary": "it has no rotary embedding, so q/k are never rotated",
    "gated_mlp": "its MLP is not gated, so there is no separate linear branch",
    "mlp_norm_input": "its blocks run attention and MLP in parallel without norms, so "
    "nothing lies between the block input and the MLP",
    "embed_norm": "it does not normalise the embedding before the first block",
    "token_types": "it has no token-type (segment) embedding",
    "head_transform": "its unembedding reads the final norm's output directly (no masked-LM "
    "head transform before it)",
    "moe": "its MLP is not a mixture of experts",
    "shared_expert": "its MLP has no shared expert beside the routed ones",
    "q_latent": "its attention does not compress queries into a latent (no multi-head latent "
    "attention, or one without a query latent)",
    "kv_latent": "its attention does not compress keys and values into a latent (no multi-head "
    "latent attention)",
    "mixer": "its blocks are not built as x + mixer(norm(x)) (they run attention and an MLP)",
    "sandwich_norm": "it has no norm after each sublayer (no sandwich norms)",
    "qk_norm": "it does not normalise queries and keys before attention",
    "attn_result": "per-head results are opt-in: boot with use_attn_result=True",
    "split_qkv_input": "per-head q/k/v inputs are opt-in on local drivers (native, hf): call "
    "model.set_use_split_qkv_input(True) (attribution patching turns them on for its sweep)",
    "cross_attention": "its blocks attend to their own stream only (cross-attention to an "
    "encoder's output exists in the decoder blocks of encoder-decoder models)",
    "norm": "it has no normalisation layers",
}

#: Why a site that needs an unestablished fact is not served, by the fact.
UNKNOWN_BECAUSE: dict[str, str] = {
    "norm": "tl did not establish its norms' weight rule, so it cannot recompute a norm's "
    "scale or pre-weight value",
    "positions": "tl did not establish its position scheme (it reads these blocks from outside "
    "only), so it serves no position site",
}

_POSITION_REQUIREMENTS = ("standard_pos", "rotary")


def requirement_unknown(
    requires: HookRequirement | None, info: ModelInfo, *, statistic: bool = False
) -> str | None:
    """The fact (``"norm"`` or ``"positions"``) a site needs when ``info`` leaves it unknown,
    else ``None``.

    Args:
        requires: The site's ``HookTemplate.requires``.
        info: The model's structure.
        statistic: Whether the site is a norm's ``hook_scale`` or ``hook_normalized``
            (``HookTemplate.statistic``), which needs the norm's weight rule.
    """
    if statistic and info.normalization_type == "unknown":
        return "norm"
    if requires in _POSITION_REQUIREMENTS and info.positional_embedding_type == "unknown":
        return "positions"
    return None


def requirement_met(
    requires: HookRequirement | None,
    info: ModelInfo,
    *,
    include_attn_result: bool = True,
    include_split_qkv_input: bool = True,
    statistic: bool = False,
) -> bool:
    """Whether a model with ``info`` has sites that need ``requires``.

    Args:
        requires: A ``HookTemplate.requires`` value.
        info: The model's structure.
        include_attn_result: What to answer for the opt-in ``"attn_result"``.
        include_split_qkv_input: What to answer for the opt-in ``"split_qkv_input"``.
        statistic: Whether the site is a norm's ``hook_scale`` or ``hook_normalized``: not
            met where the norms' weight rule is unknown.

    Returns:
        ``True`` when the model has such sites.
    """
    if statistic and info.normalization_type == "unknown":
        return False
    if requires is None:
        return True
    if requires == "standard_pos":
        return info.positional_embedding_type == "standard"
    if requires == "rotary":
        return info.positional_embedding_type == "rotary"
    if requires == "gated_mlp":
        return info.gated_mlp
    if requires == "mlp_norm_input":
        return not info.parallel_attn_mlp or info.normalization_type is not None
    if requires == "embed_norm":
        return info.embed_norm
    if requires == "token_types":
        return info.token_type_embed
    if requires == "head_transform":
        return info.head_transform
    if requires == "moe":
        return info.n_experts is not None
    if requires == "shared_expert":
        return info.d_shared_expert is not None
    if requires == "q_latent":
        return info.d_q_latent is not None
    if requires == "kv_latent":
        return info.d_kv_latent is not None
    if requires == "mixer":
        return info.mixer
    if requires == "sandwich_norm":
        return info.sandwich_norm
    if requires == "qk_norm":
        return info.qk_norm
    if requires == "attn_result":
        return include_attn_result
    if requires == "split_qkv_input":
        return include_split_qkv_input
    if requires == "cross_attention":
        return info.cross_attention
    return info.normalization_type is not None
