"""Where each supported architecture keeps its sites inside vLLM's model, and its ModelInfo.

A ``Layout`` names submodules by attribute path, so the same table serves the worker (which
installs hooks on vLLM's modules) and the driver (which checks the family and builds the
``ModelInfo`` from the checkpoint's config before any engine exists). This module imports
neither torch nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tl_core import ConfigError, ModelInfo

__all__ = ["LAYOUTS", "Layout", "layout_for", "model_info"]

NormKind = Literal["rms", "gemma_rms", "ln"]


@dataclass(frozen=True)
class Layout:
    """How one architecture family is laid out inside vLLM's ``*ForCausalLM`` module.

    Attributes:
        inner: Attribute of the top-level model holding the decoder (``"model"``).
        embed: Token embedding, relative to ``inner``.
        pos_embed: Learned positional embedding relative to ``inner``, or ``None``.
        layers: The ``ModuleList`` of decoder layers, relative to ``inner``.
        final_norm: The final norm, relative to ``inner``.
        attn: Attention module, relative to a layer.
        mlp: MLP module, relative to a layer.
        ln2: The norm whose input is the residual between attention and MLP.
        ln1_post: Post-attention norm of sandwich-norm families, or ``None``.
        ln2_post: Post-MLP norm of sandwich-norm families, or ``None``.
        residual_pair: Whether layers pass ``(delta, residual)`` pairs (fused add-norm)
            rather than one residual-stream tensor.
        norm: ``"rms"`` (``w * x / rms``), ``"gemma_rms"`` (``(1 + w) * x / rms``) or
            ``"ln"`` (LayerNorm with bias).
        lm_head: Unembedding module: ``"lm_head"`` on the top-level model, or ``"embed"``
            when the model projects with its (tied) token embedding directly.
    """

    inner: str
    embed: str
    pos_embed: str | None
    layers: str
    final_norm: str
    attn: str
    mlp: str
    ln2: str
    ln1_post: str | None
    ln2_post: str | None
    residual_pair: bool
    norm: NormKind
    lm_head: Literal["lm_head", "embed"]


_LLAMA = Layout(
    inner="model",
    embed="embed_tokens",
    pos_embed=None,
    layers="layers",
    final_norm="norm",
    attn="self_attn",
    mlp="mlp",
    ln2="post_attention_layernorm",
    ln1_post=None,
    ln2_post=None,
    residual_pair=True,
    norm="rms",
    lm_head="lm_head",
)
_GEMMA = Layout(**{**_LLAMA.__dict__, "norm": "gemma_rms"})
_GEMMA2 = Layout(
    **{
        **_GEMMA.__dict__,
        "ln2": "pre_feedforward_layernorm",
        "ln1_post": "post_attention_layernorm",
        "ln2_post": "post_feedforward_layernorm",
        "lm_head": "embed",
    }
)
_GPT2 = Layout(
    inner="transformer",
    embed="wte",
    pos_embed="wpe",
    layers="h",
    final_norm="ln_f",
    attn="attn",
    mlp="mlp",
    ln2="ln_2",
    ln1_post=None,
    ln2_post=None,
    residual_pair=False,
    norm="ln",
    lm_head="lm_head",
)

#: vLLM architecture name -> layout. Every entry is covered by the parity tests.
LAYOUTS: dict[str, Layout] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "GemmaForCausalLM": _GEMMA,
    "Gemma2ForCausalLM": _GEMMA2,
    "GPT2LMHeadModel": _GPT2,
}


def layout_for(architecture: str) -> Layout:
    """The layout of a supported architecture.

    Args:
        architecture: The checkpoint's ``architectures[0]`` (``"LlamaForCausalLM"``).

    Returns:
        Its layout.

    Raises:
        ConfigError: The architecture is not supported, naming the supported ones.
    """
    layout = LAYOUTS.get(architecture)
    if layout is None:
        raise ConfigError(
            f"the vllm driver does not support architecture {architecture!r}; supported: "
            f"{', '.join(sorted(LAYOUTS))}. Each family needs a table of where vLLM keeps "
            "its sites (tl_driver_vllm._families.LAYOUTS) and parity tests; use the hf "
            "driver for other models."
        )
    return layout


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def model_info(config: Any, *, max_model_len: int | None = None) -> ModelInfo:
    """Build the ``ModelInfo`` of a checkpoint from its ``transformers`` config.

    Args:
        config: A ``transformers.PretrainedConfig`` (text config for multimodal wrappers).
        max_model_len: The engine's context limit, when known (else the config's).

    Returns:
        The model's sizes and structure.

    Raises:
        ConfigError: Unsupported architecture or a config missing a size.
    """
    architecture = (getattr(config, "architectures", None) or ["<none>"])[0]
    layout = layout_for(architecture)
    d_model = _get(config, "hidden_size", "n_embd")
    n_heads = _get(config, "num_attention_heads", "n_head")
    n_layers = _get(config, "num_hidden_layers", "n_layer")
    if d_model is None or n_heads is None or n_layers is None:
        raise ConfigError(
            f"config of {architecture!r} lacks hidden_size, num_attention_heads or "
            "num_hidden_layers; is this a complete transformers config.json?"
        )
    d_head = _get(config, "head_dim", default=d_model // n_heads)
    gpt2 = layout.norm == "ln"
    n_ctx = max_model_len or _get(config, "max_position_embeddings", "n_positions", default=0)
    return ModelInfo(
        n_layers=int(n_layers),
        d_model=int(d_model),
        n_heads=int(n_heads),
        d_head=int(d_head),
        d_mlp=int(_get(config, "intermediate_size", "n_inner", default=4 * d_model)),
        d_vocab=int(config.vocab_size),
        n_ctx=int(n_ctx),
        n_key_value_heads=int(_get(config, "num_key_value_heads", default=n_heads)),
        normalization_type="LN" if gpt2 else "RMS",
        positional_embedding_type="standard" if gpt2 else "rotary",
        gated_mlp=not gpt2,
        parallel_attn_mlp=False,
        sandwich_norm=layout.ln1_post is not None,
        architecture=architecture,
    )
