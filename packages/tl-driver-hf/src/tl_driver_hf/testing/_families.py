"""The table of tiny architecture families: config class, model class and config fields."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["FAMILIES", "VLLM_CPU_HEAD_SIZES", "Family", "TinyDims"]

# vLLM's CPU attention kernels only exist for these head sizes; every tiny model uses one.
VLLM_CPU_HEAD_SIZES: Final = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

_ROPE_THETA: Final = 10_000.0


@dataclass(frozen=True)
class TinyDims:
    """The resolved sizes of a tiny model, in family-neutral names."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_mlp: int
    vocab_size: int
    n_ctx: int


@dataclass(frozen=True)
class Family:
    """One architecture family.

    Attributes:
        config_class: Name of the config class in the ``transformers`` namespace.
        model_class: Name of the causal-LM class in the ``transformers`` namespace.
        kv: ``"mha"`` (one key/value head per query head), ``"gqa"`` (groups of two query
            heads share one) or ``"mqa"`` (one key/value head for all).
        own_head_dim: Whether the config has a ``head_dim`` field independent of
            ``hidden_size / num_attention_heads``.
        fields: Config keyword arguments for given sizes (token ids are added elsewhere).
        init_std_field: The config field holding the std of the weight initialisation.
    """

    config_class: str
    model_class: str
    kv: Literal["mha", "gqa", "mqa"]
    own_head_dim: bool
    fields: Callable[[TinyDims], dict[str, Any]]
    init_std_field: str = "initializer_range"


def _llama_like(d: TinyDims, *, head_dim: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "num_hidden_layers": d.n_layers,
        "hidden_size": d.d_model,
        "num_attention_heads": d.n_heads,
        "num_key_value_heads": d.n_kv_heads,
        "intermediate_size": d.d_mlp,
        "max_position_embeddings": d.n_ctx,
        "vocab_size": d.vocab_size,
        "rope_theta": _ROPE_THETA,
    }
    if head_dim:
        fields["head_dim"] = d.head_dim
    return fields


def _gpt_neo_attention_types(n_layers: int) -> list[Any]:
    # GPT-Neo alternates global and local attention, written as [[pattern, repeats], ...].
    types: list[Any] = [[["global", "local"], n_layers // 2]] if n_layers >= 2 else []
    if n_layers % 2:
        types.append([["global"], 1])
    return types


def _gemma_sandwich(d: TinyDims) -> dict[str, Any]:
    # Scaling queries by head_dim as Gemma 2/3 checkpoints do; a window >= n_ctx makes the
    # sliding layers compute the same as full attention, so no engine can disagree on it.
    return {
        **_llama_like(d, head_dim=True),
        "query_pre_attn_scalar": d.head_dim,
        "sliding_window": d.n_ctx,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d.n_layers)
        ],
    }


FAMILIES: Final[dict[str, Family]] = {
    "gpt2": Family(
        "GPT2Config",
        "GPT2LMHeadModel",
        "mha",
        False,
        lambda d: {
            "n_layer": d.n_layers,
            "n_embd": d.d_model,
            "n_head": d.n_heads,
            "n_inner": d.d_mlp,
            "n_positions": d.n_ctx,
            "vocab_size": d.vocab_size,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "summary_first_dropout": 0.0,
        },
    ),
    "gpt_neo": Family(
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        "mha",
        False,
        lambda d: {
            "num_layers": d.n_layers,
            "attention_types": _gpt_neo_attention_types(d.n_layers),
            "hidden_size": d.d_model,
            "num_heads": d.n_heads,
            "intermediate_size": d.d_mlp,
            "max_position_embeddings": d.n_ctx,
            "window_size": d.n_ctx,
            "vocab_size": d.vocab_size,
        },
    ),
    "gptj": Family(
        "GPTJConfig",
        "GPTJForCausalLM",
        "mha",
        False,
        lambda d: {
            "n_layer": d.n_layers,
            "n_embd": d.d_model,
            "n_head": d.n_heads,
            "n_inner": d.d_mlp,
            "n_positions": d.n_ctx,
            "rotary_dim": d.head_dim // 2,
            "vocab_size": d.vocab_size,
        },
    ),
    "gpt_neox": Family(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        "mha",
        False,
        lambda d: {
            "num_hidden_layers": d.n_layers,
            "hidden_size": d.d_model,
            "num_attention_heads": d.n_heads,
            "intermediate_size": d.d_mlp,
            "max_position_embeddings": d.n_ctx,
            "vocab_size": d.vocab_size,
            "rope_theta": _ROPE_THETA,
        },
    ),
    "opt": Family(
        "OPTConfig",
        "OPTForCausalLM",
        "mha",
        False,
        lambda d: {
            "num_hidden_layers": d.n_layers,
            "hidden_size": d.d_model,
            "word_embed_proj_dim": d.d_model,
            "num_attention_heads": d.n_heads,
            "ffn_dim": d.d_mlp,
            "max_position_embeddings": d.n_ctx,
            "vocab_size": d.vocab_size,
            "dropout": 0.0,
        },
        init_std_field="init_std",
    ),
    # BLOOM has ALiBi (no position limit) and a fixed 4 * d_model MLP.
    "bloom": Family(
        "BloomConfig",
        "BloomForCausalLM",
        "mha",
        False,
        lambda d: {
            "n_layer": d.n_layers,
            "hidden_size": d.d_model,
            "n_head": d.n_heads,
            "vocab_size": d.vocab_size,
        },
    ),
    "llama": Family(
        "LlamaConfig", "LlamaForCausalLM", "gqa", True, lambda d: _llama_like(d, head_dim=True)
    ),
    "mistral": Family(
        "MistralConfig",
        "MistralForCausalLM",
        "gqa",
        True,
        lambda d: {**_llama_like(d, head_dim=True), "sliding_window": d.n_ctx},
    ),
    "mixtral": Family(
        "MixtralConfig",
        "MixtralForCausalLM",
        "gqa",
        True,
        lambda d: {
            **_llama_like(d, head_dim=True),
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen2": Family(
        "Qwen2Config", "Qwen2ForCausalLM", "gqa", False, lambda d: _llama_like(d, head_dim=False)
    ),
    "qwen3": Family(
        "Qwen3Config", "Qwen3ForCausalLM", "gqa", True, lambda d: _llama_like(d, head_dim=True)
    ),
    # Gemma 2B uses multi-query attention (7B uses one key/value head per query head).
    "gemma": Family(
        "GemmaConfig", "GemmaForCausalLM", "mqa", True, lambda d: _llama_like(d, head_dim=True)
    ),
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "gqa",
        True,
        lambda d: {
            **_gemma_sandwich(d),
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "gqa",
        True,
        lambda d: {**_gemma_sandwich(d), "rope_local_base_freq": _ROPE_THETA},
    ),
    "phi3": Family(
        "Phi3Config",
        "Phi3ForCausalLM",
        "gqa",
        False,
        lambda d: {
            **_llama_like(d, head_dim=False),
            "original_max_position_embeddings": d.n_ctx,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
        },
    ),
    "olmo2": Family(
        "Olmo2Config", "Olmo2ForCausalLM", "gqa", False, lambda d: _llama_like(d, head_dim=False)
    ),
    # Falcon-7B layout: one shared key/value head, attention and MLP in parallel, rotary.
    # The MLP is 4 * d_model wide, as in every Falcon checkpoint: vLLM's Falcon ignores
    # ffn_hidden_size and builds 4 * d_model, so any other width fails to load there.
    "falcon": Family(
        "FalconConfig",
        "FalconForCausalLM",
        "mqa",
        False,
        lambda d: {
            "num_hidden_layers": d.n_layers,
            "hidden_size": d.d_model,
            "num_attention_heads": d.n_heads,
            "ffn_hidden_size": 4 * d.d_model,
            "max_position_embeddings": d.n_ctx,
            "vocab_size": d.vocab_size,
            "multi_query": True,
            "new_decoder_architecture": False,
            "parallel_attn": True,
            "alibi": False,
            "rope_theta": _ROPE_THETA,
        },
    ),
    "stablelm": Family(
        "StableLmConfig",
        "StableLmForCausalLM",
        "mha",
        False,
        lambda d: _llama_like(d, head_dim=False),
    ),
}
"""Family name (the ``transformers`` ``model_type``, ``gemma3`` being the text-only model)
to how to build it. Word-embedding tying follows each config's default."""
