"""Where each supported architecture keeps its sites inside vLLM's model, and its ModelInfo.

A ``Layout`` names submodules by attribute path, so the same table serves the worker (which
installs hooks on vLLM's modules) and the driver (which checks the family and builds the
``ModelInfo`` and hook namespace from the checkpoint's config before any engine exists).
This module imports neither torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from tl_core import ConfigError, ModelInfo
from tl_core.driver_api import model_info_from_config

__all__ = ["LAYOUTS", "Layout", "NormKind", "layout_for", "model_info"]

NormKind = Literal["rms", "gemma_rms", "ln"]


@dataclass(frozen=True)
class Layout:
    """How one architecture family is laid out inside vLLM's ``*ForCausalLM`` module.

    One instance per family, keyed by architecture name in ``LAYOUTS``. The worker installs
    hooks from these fields alone (``tl_driver_vllm._sites``), and the driver derives the
    ``ModelInfo`` and the hook namespace from them, so adding a family whose vLLM module has
    this shape is one table row plus its parity test.

    **Paths.** Every module is named by a dotted attribute path relative to its parent:
    model-level parts relative to ``inner``, block parts relative to one decoder layer,
    attention parts relative to ``attn``, MLP parts relative to ``mlp``. An empty path
    (``""``) names the parent itself (an MLP whose projections sit in the layer). ``None``
    means the family has no such module; the sites read there are then not served.

    **Sites and where they are read** (see the package README for the full table):

    * ``qkv`` output, split per head: ``attn.hook_q``/``hook_k`` (rotary families only;
      before QK-norm and rotary). Its parts are ``[q | k | v]`` with this rank's
      ``num_heads``/``num_kv_heads`` (read from the ``attention`` module) when
      ``qkv_layout="blocks"``, or ``[q_h | k_h | v_h]`` per head when ``"heads"``.
    * ``attention`` input (vLLM's ``Attention`` layer, called ``(query, key, value)``):
      ``attn.hook_rot_q``/``hook_rot_k`` on rotary families, ``attn.hook_q``/``hook_k`` on
      the others, and ``attn.hook_v`` on all: the tensors attention actually receives.
      Attention patterns and scores are rebuilt from them per request with the module's
      own scale, soft-cap, sliding window and ALiBi slopes (``_patterns``).
    * ``o_proj`` input: ``attn.hook_z``; its weight gives ``attn.hook_result``.
    * ``q_norm``/``k_norm`` input and output: ``attn.q_norm.*``/``attn.k_norm.*``; the norm
      sees ``[tokens, heads, d_head]`` when ``qk_norm_layout="heads"`` or the flat
      ``[tokens, heads * d_head]`` (one scale per position, served repeated per head)
      when ``"flat"``.
    * ``gate_up`` output halves: ``mlp.hook_pre`` (gate) and ``mlp.hook_pre_linear`` (up);
      ``fc_in`` output: ``mlp.hook_pre`` of a non-gated MLP; ``down`` input:
      ``mlp.hook_post``. The activation needs no entry: ``hook_post`` is what ``down`` reads.
    * ``router`` output (mixture of experts; a module returning the router logits, or a
      tuple starting with them): ``mlp.hook_router_logits``, with
      ``hook_expert_weights``/``hook_expert_indices`` derived from them by the family's
      top-k routing (softmax, top ``experts_per_token``, renormalised).
    * ``ln1``, ``ln2``, ``ln1_post``, ``ln2_post`` input and output: the norms' ``hook_in``
      and ``hook_out``; ``hook_scale``/``hook_normalized`` are derived from the input.

    **Adding a family.** Start from the row of a family with the same module shape
    (``dataclasses.replace``), change the paths and flags that differ, add the row to
    ``LAYOUTS`` and the family to the parity tests. A new structural variant (a parallel
    block, a norm placement vLLM fuses differently) gets a new field with a default that
    keeps the existing rows unchanged, and its handling in ``_sites``.

    Attributes:
        inner: Attribute of the top-level model holding the decoder (``"model"``).
        embed: Token embedding, relative to ``inner``.
        pos_embed: Learned positional embedding relative to ``inner``, or ``None``.
        layers: The ``ModuleList`` of decoder layers, relative to ``inner``.
        final_norm: The final norm, relative to ``inner``.
        ln1: The pre-attention norm, relative to a layer.
        attn: Attention block, relative to a layer.
        mlp: MLP (or mixture-of-experts) block, relative to a layer.
        ln2: The norm whose input is the residual between attention and MLP.
        ln1_post: Post-attention norm of sandwich-norm families, or ``None``.
        ln2_post: Post-MLP norm of sandwich-norm families, or ``None``.
        residual_pair: Whether layers pass ``(delta, residual)`` pairs and the pre-sublayer
            norms are called ``norm(delta, residual)`` (fused add-norm) after layer 0,
            rather than one residual-stream tensor.
        layer_input: Index of the hidden-states argument of a layer's ``forward``: ``1``
            for ``(positions, hidden_states[, residual])``, ``0`` for ``(hidden_states,)``.
        norm: ``"rms"`` (``w * x / rms``), ``"gemma_rms"`` (``(1 + w) * x / rms``) or
            ``"ln"`` (LayerNorm with bias); every norm of the family.
        lm_head: Unembedding module: ``"lm_head"`` on the top-level model, or ``"embed"``
            when the model projects with its (tied) token embedding directly.
        embed_scaled: Whether the model multiplies the embedding by ``sqrt(d_model)`` after
            the embedding module (Gemma): ``embed.hook_out`` is then read where that value
            enters block 0.
        qkv: Fused query/key/value projection, relative to ``attn``.
        qkv_layout: ``"blocks"`` (``[q | k | v]``) or ``"heads"`` (``[q_h | k_h | v_h]``).
        attention: vLLM's ``Attention`` layer, relative to ``attn``.
        o_proj: Output projection, relative to ``attn``.
        rotary: The rotary embedding module relative to ``attn``, or ``None`` for families
            without rotary positions (then ``hook_q``/``hook_k`` are read at attention).
        q_norm: Query norm relative to ``attn`` (QK-norm families), or ``None``.
        k_norm: Key norm relative to ``attn``, or ``None``.
        qk_norm_layout: ``"heads"`` or ``"flat"``, see above.
        gate_up: Fused ``[gate | up]`` projection relative to ``mlp``, or ``None``.
        fc_in: Input projection of a non-gated MLP relative to ``mlp``, or ``None``.
        down: Output projection relative to ``mlp``, or ``None``.
        router: Router of a mixture-of-experts block relative to ``mlp``, or ``None``.
        config_requires: Config values the layout assumes, with the reason when one differs
            (checked before the engine starts).
    """

    inner: str
    embed: str
    pos_embed: str | None
    layers: str
    final_norm: str
    ln1: str
    attn: str
    mlp: str
    ln2: str
    ln1_post: str | None
    ln2_post: str | None
    residual_pair: bool
    layer_input: int
    norm: NormKind
    lm_head: Literal["lm_head", "embed"]
    embed_scaled: bool = False
    qkv: str = "qkv_proj"
    qkv_layout: Literal["blocks", "heads"] = "blocks"
    attention: str = "attn"
    o_proj: str = "o_proj"
    rotary: str | None = "rotary_emb"
    q_norm: str | None = None
    k_norm: str | None = None
    qk_norm_layout: Literal["heads", "flat"] = "heads"
    gate_up: str | None = "gate_up_proj"
    fc_in: str | None = None
    down: str | None = "down_proj"
    router: str | None = None
    config_requires: Mapping[str, tuple[Any, str]] = field(default_factory=dict)

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate (``hook_pre_linear`` exists)."""
        return self.gate_up is not None

    @property
    def moe(self) -> bool:
        """Whether the MLP is a mixture of experts (no single layer of neurons)."""
        return self.router is not None

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are normalised before attention."""
        return self.q_norm is not None

    def config_problems(self, config: Any) -> list[str]:
        """Why this layout cannot serve ``config`` (empty when it can)."""
        return [
            f"{name}={getattr(config, name, None)!r} (expected {want!r}): {why}"
            for name, (want, why) in self.config_requires.items()
            if getattr(config, name, want) != want
        ]


_LLAMA = Layout(
    inner="model",
    embed="embed_tokens",
    pos_embed=None,
    layers="layers",
    final_norm="norm",
    ln1="input_layernorm",
    attn="self_attn",
    mlp="mlp",
    ln2="post_attention_layernorm",
    ln1_post=None,
    ln2_post=None,
    residual_pair=True,
    layer_input=1,
    norm="rms",
    lm_head="lm_head",
)
_QWEN3 = replace(_LLAMA, q_norm="q_norm", k_norm="k_norm")
_GEMMA = replace(_LLAMA, norm="gemma_rms", embed_scaled=True)
_GEMMA2 = replace(
    _GEMMA,
    ln2="pre_feedforward_layernorm",
    ln1_post="post_attention_layernorm",
    ln2_post="post_feedforward_layernorm",
    lm_head="embed",
)
_GEMMA3 = replace(_GEMMA2, lm_head="lm_head", q_norm="q_norm", k_norm="k_norm")
_MIXTRAL = replace(_LLAMA, mlp="block_sparse_moe", gate_up=None, down=None, router="gate")
_STABLELM = replace(
    _LLAMA,
    residual_pair=False,
    norm="ln",
    config_requires={
        "use_parallel_residual": (False, "vLLM's StableLM layer runs attention and MLP in sequence"),
        "qk_layernorm": (False, "vLLM's StableLM attention has no query/key norms"),
    },
)
_GPT2 = Layout(
    inner="transformer",
    embed="wte",
    pos_embed="wpe",
    layers="h",
    final_norm="ln_f",
    ln1="ln_1",
    attn="attn",
    mlp="mlp",
    ln2="ln_2",
    ln1_post=None,
    ln2_post=None,
    residual_pair=False,
    layer_input=0,
    norm="ln",
    lm_head="lm_head",
    qkv="c_attn",
    o_proj="c_proj",
    rotary=None,
    gate_up=None,
    fc_in="c_fc",
    down="c_proj",
)

#: vLLM architecture name -> layout. Every entry is covered by the parity tests.
LAYOUTS: dict[str, Layout] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _QWEN3,
    "Phi3ForCausalLM": _LLAMA,
    "MixtralForCausalLM": _MIXTRAL,
    "GemmaForCausalLM": _GEMMA,
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA3,
    "StableLmForCausalLM": _STABLELM,
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
        ConfigError: Unsupported architecture, a config the layout cannot serve, or a
            config missing a size.
    """
    architecture = (getattr(config, "architectures", None) or ["<none>"])[0]
    layout = layout_for(architecture)
    problems = layout.config_problems(config)
    if problems:
        raise ConfigError(
            f"the vllm driver cannot serve this {architecture!r} checkpoint: "
            f"{'; '.join(problems)}. Use the hf driver for it."
        )
    return model_info_from_config(
        config,
        normalization_type="LN" if layout.norm == "ln" else "RMS",
        positional_embedding_type=(
            "standard" if layout.pos_embed else "rotary" if layout.rotary else "none"
        ),
        gated_mlp=layout.gated,
        sandwich_norm=layout.ln1_post is not None,
        qk_norm=layout.qk_norm,
        moe=layout.moe,
        architecture=architecture,
        n_ctx=max_model_len,
    )
