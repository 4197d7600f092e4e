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
from tl_core.driver_api import model_info_from_config

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
        embed_scaled: Whether the model multiplies the embedding by ``sqrt(d_model)`` after
            the embedding module (Gemma): ``embed.hook_out`` is then read where that value
            enters block 0.
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
    embed_scaled: bool = False


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
_GEMMA = Layout(**{**_LLAMA.__dict__, "norm": "gemma_rms", "embed_scaled": True})
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


def model_info(config: Any, *, max_model_len: int | None = None) -> ModelInfo:
    """Build the ``ModelInfo`` of a checkpoint from its ``transformers`` config.

    Args:
        config: A ``transformers.PretrainedConfig`` (text config for multimodal wrappers).
        max_model_len: The engine's context limit, when known (else the config's).

    Returns:
        Sizes from tl-core's config reader, structure from the family's layout.

    Raises:
        ConfigError: Unsupported architecture or a config missing a size.
    """
    architecture = (getattr(config, "architectures", None) or ["<none>"])[0]
    layout = layout_for(architecture)
    gpt2 = layout.norm == "ln"
    return model_info_from_config(
        config,
        normalization_type="LN" if gpt2 else "RMS",
        positional_embedding_type="standard" if gpt2 else "rotary",
        gated_mlp=not gpt2,
        sandwich_norm=layout.ln1_post is not None,
        qk_norm=architecture == "Qwen3ForCausalLM",
        architecture=architecture,
        n_ctx=max_model_len,
    )
