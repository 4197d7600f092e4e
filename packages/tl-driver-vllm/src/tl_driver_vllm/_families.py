"""Where each supported architecture keeps its sites inside vLLM's model.

A ``Layout`` names submodules by attribute path, so the same table serves the worker (which
installs hooks on vLLM's modules) and the driver (which checks the family and builds the
hook namespace before any engine exists). What a family *is* (its norms and where they sit,
parallel or sequential, positions, MLP variant, the configs it cannot describe) is its
``tl_core.architecture`` description, found by architecture name (``family_for``); a row
holds only vLLM's paths and what vLLM's model class does differently, and is checked
against its description (``disagreements``). This module imports neither torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from tl_core import ConfigError, ModelInfo
from tl_core.architecture import FamilyDescription, family_description

__all__ = [
    "FAMILY_LAYOUTS",
    "NOT_RUN_BY_VLLM",
    "Layout",
    "architecture_of",
    "disagreements",
    "family_for",
    "layout_for",
    "model_info",
    "resolve",
    "settle",
]


@dataclass(frozen=True)
class Layout:
    """How one architecture family is laid out inside vLLM's ``*ForCausalLM`` module.

    One instance per family, keyed by architecture name in ``FAMILY_LAYOUTS``. The worker installs
    hooks from these paths and the family's settled description
    (``tl_driver_vllm._worker_side._sites``); the driver builds the hook namespace from both,
    so adding a family whose vLLM module has this shape is one description row in tl-core,
    one table row here, and its parity test (``docs/adding-a-family.md``).

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
    * ``ln1``, ``ln2``, ``ln1_post``, ``ln2_post``, ``embed_norm`` input and output: the
      norms' ``hook_in`` and ``hook_out``; ``hook_scale``/``hook_normalized`` are derived
      from the input.
    * ``ln2.hook_in`` where there is no ``ln2``: the MLP's input, which is the residual
      stream itself (OLMo 2, edited in place), or, in a ``parallel`` block whose one norm
      feeds both sublayers (GPT-J, Falcon-7B), the block input re-normalised for the MLP.

    **Transformers backend.** vLLM runs some architectures (GPT-NeoX, OLMo 2) as
    transformers' own modules with vLLM's linear layers, norms and ``Attention`` inside
    (``backend="transformers"``). Their tensors carry a leading batch axis of size 1, which
    every site hides, and their ``Attention`` layer is called through ``forward`` directly,
    so its inputs are read by wrapping that method for the run.

    **Adding a family.** Write (or find) its description in ``tl_core.architecture``. Start
    from the row of a family with the same module shape (``dataclasses.replace``), change the
    paths that differ, add the row to ``FAMILY_LAYOUTS`` and the family to the parity tests.
    A path exists exactly where the description says the module does. A new way vLLM's
    module computes (a norm placement vLLM fuses differently) gets a new field with a default
    that keeps the existing rows unchanged, and its handling in ``_sites``.

    Attributes:
        inner: Attribute of the top-level model holding the decoder (``"model"``).
        embed: Token embedding, relative to ``inner``.
        pos_embed: Learned positional embedding relative to ``inner``, or ``None``.
        layers: The ``ModuleList`` of decoder layers, relative to ``inner``.
        final_norm: The final norm, relative to ``inner``.
        ln1: The pre-attention norm, relative to a layer, or ``None`` (OLMo 2 has none).
        attn: Attention block, relative to a layer.
        mlp: MLP (or mixture-of-experts) block, relative to a layer.
        ln2: The pre-MLP norm, relative to a layer: its input is the residual between
            attention and MLP (or, in a parallel block, the block input); ``None`` where
            the MLP reads the residual directly (OLMo 2) or one norm feeds both sublayers.
        ln1_post: Post-attention norm of sandwich-norm families, or ``None``.
        ln2_post: Post-MLP norm of sandwich-norm families, or ``None``.
        residual_pair: Whether layers pass ``(delta, residual)`` pairs and the pre-sublayer
            norms are called ``norm(delta, residual)`` (fused add-norm) after layer 0,
            rather than one residual-stream tensor.
        layer_input: Index of the hidden-states argument of a layer's ``forward``: ``1``
            for ``(positions, hidden_states[, residual])``, ``0`` for ``(hidden_states,)``.
        lm_head: Unembedding module: ``"lm_head"`` on the top-level model, or ``"embed"``
            when the model projects with its (tied) token embedding directly.
        qkv: Fused query/key/value projection, relative to ``attn``.
        qkv_layout: ``"blocks"`` (``[q | k | v]``) or ``"heads"`` (``[q_h | k_h | v_h]``).
        attention: vLLM's ``Attention`` layer, relative to ``attn``.
        o_proj: Output projection, relative to ``attn``.
        rotary: The rotary embedding module relative to ``attn``, or ``None`` for families
            without rotary positions (then ``hook_q``/``hook_k`` are read at attention). On
            the Transformers backend, whose attention code rotates with the table the model
            hands it, the model's rotary module relative to ``inner``.
        q_norm: Query norm relative to ``attn`` (QK-norm families), or ``None``.
        k_norm: Key norm relative to ``attn``, or ``None``.
        qk_norm_layout: ``"heads"`` or ``"flat"``, see above.
        gate_up: Fused ``[gate | up]`` projection relative to ``mlp``, or ``None``.
        fc_in: Input projection of a non-gated MLP relative to ``mlp``, or ``None``.
        down: Output projection relative to ``mlp``, or ``None``.
        router: Router of a mixture-of-experts block relative to ``mlp``, or ``None``.
        vllm_requires: Config values vLLM's model class needs beyond what the description
            requires, with the reason when one differs (checked before the engine starts).
        embed_norm: A norm applied to the embedding before block 0 (BLOOM's
            ``word_embeddings_layernorm``) relative to ``inner``, served as ``embed_ln.*``.
            In a parallel block (the description's ``is_parallel``) with ``ln2`` the MLP's
            own norm reads the block input (GPT-NeoX): an ``ln2.hook_in`` edit replaces
            that norm's input only. Without ``ln2`` one norm (``ln1``) feeds both (GPT-J,
            Falcon-7B): ``ln2.hook_in`` is the block input as the MLP sees it, and an edit
            reaches the MLP as ``ln1(edited)`` while attention keeps the unedited norm.
        backend: ``"native"`` (vLLM's own model class) or ``"transformers"`` (vLLM's
            Transformers backend, ``TransformersForCausalLM``), see above.
        partial_outputs: Whether vLLM leaves each tensor-parallel rank's attention and MLP
            outputs as partial sums and all-reduces them once, after adding them (Falcon's
            parallel block). Under tensor parallelism ``attn.hook_out`` and ``mlp.hook_out``
            are then not served and ``attn.hook_result`` is read-only; with one rank the
            outputs are whole and everything is served.
        activation: ``(path relative to mlp, vLLM activation name)`` where vLLM's model
            computes another activation than the checkpoint defines: the worker installs
            the checkpoint's at boot (with a log line), so the engine computes the model
            transformers and the hf driver compute. ``None`` where vLLM's is the checkpoint's.
        attn_input: Position of the hidden states among the attention module's positional
            arguments (``-1``: last, after the positions; gpt-oss passes them first).
        residual_offset: How many arguments after the hidden states a layer takes its
            ``residual`` (``residual_pair`` families): 1, or 2 where the positions come
            between (gpt-oss).
        withheld: Hook templates this row places but the vllm driver does not serve, with
            the reason: the hf driver serves the family by inference, where no equation
            certifies them, and a name must mean the same tensor on both drivers or on
            neither (``tests/test_units.py`` checks the list against the hf driver's).
    """

    inner: str
    embed: str
    pos_embed: str | None
    layers: str
    final_norm: str
    ln1: str | None
    attn: str
    mlp: str
    ln2: str | None
    ln1_post: str | None
    ln2_post: str | None
    residual_pair: bool
    layer_input: int
    lm_head: Literal["lm_head", "embed"]
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
    vllm_requires: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    embed_norm: str | None = None
    backend: Literal["native", "transformers"] = "native"
    partial_outputs: bool = False
    activation: tuple[str, str] | None = None
    residual_offset: int = 1
    attn_input: int = -1
    withheld: Mapping[str, str] = field(default_factory=dict)

    @property
    def batched(self) -> bool:
        """Whether tensors inside the model carry a leading batch axis of size 1."""
        return self.backend == "transformers"

    @property
    def mlp_inline(self) -> bool:
        """Whether the MLP's projections sit in the layer itself (``mlp`` is ``""``, OPT)."""
        return self.mlp == ""

    def config_problems(self, config: Any) -> list[str]:
        """Why vLLM's model class cannot run ``config`` (empty when it can); what the
        description cannot describe is ``FamilyDescription.config_problems``."""
        return [
            f"{name}={getattr(config, name, None)!r} (expected {want!r}): {why}"
            for name, (want, why) in self.vllm_requires.items()
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
    lm_head="lm_head",
)
_QWEN3 = replace(_LLAMA, q_norm="q_norm", k_norm="k_norm")
_GEMMA2 = replace(
    _LLAMA,
    ln2="pre_feedforward_layernorm",
    ln1_post="post_attention_layernorm",
    ln2_post="post_feedforward_layernorm",
    lm_head="embed",
)
_GEMMA3 = replace(_GEMMA2, lm_head="lm_head", q_norm="q_norm", k_norm="k_norm")
_MIXTRAL = replace(_LLAMA, mlp="block_sparse_moe", gate_up=None, down=None, router="gate")
#: What the vllm driver withholds on a row of a family the hf driver serves by inference.
_INFERRED_ON_HF = {
    "blocks.{i}.attn.hook_result": (
        "the hf driver serves this family by inference, where no equation certifies the "
        "per-head results; the vllm driver does not serve them either, so a name means the "
        "same tensor on both drivers"
    ),
}
# Mixtures of experts whose block is `mlp`.
_QWEN3_MOE = replace(
    _QWEN3, mlp="mlp", gate_up=None, down=None, router="gate", withheld=_INFERRED_ON_HF
)
_QWEN2_MOE = replace(_QWEN3_MOE, q_norm=None, k_norm=None)
_OLMOE = replace(
    _QWEN3_MOE,
    qk_norm_layout="flat",
    vllm_requires={
        "norm_topk_prob": (False, "vLLM's OLMoE never renormalises the chosen experts' weights"),
    },
)
# EXAONE 4: vLLM's own class passes the whole stream between layers.
_EXAONE4 = replace(
    _QWEN3,
    ln1=None,
    ln2=None,
    ln1_post="post_attention_layernorm",
    ln2_post="post_feedforward_layernorm",
    residual_pair=False,
    withheld=_INFERRED_ON_HF,
)
# gpt-oss: vLLM's own class names the embedding `embedding` and attention `attn`, passes
# hidden states first; the pattern rebuild counts its attention sinks.
_GPT_OSS = replace(
    _LLAMA,
    embed="embedding",
    attn="attn",
    layer_input=0,
    residual_offset=2,
    attn_input=0,
    gate_up=None,
    down=None,
    router="router",
    withheld=_INFERRED_ON_HF,
)
_NO_HF_ROUTER = (
    "the hf driver finds no module of transformers' Granite-MoE that returns (logits, "
    "weights, indices) as a router, so neither driver serves the routing sites"
)
_GRANITE_MOE = replace(
    _MIXTRAL,
    vllm_requires={
        "embedding_multiplier": (1.0, "vLLM's Granite scales the embedding after its module"),
        "residual_multiplier": (
            1.0,
            "vLLM's Granite scales each sublayer's output after its module",
        ),
    },
    withheld={
        **_INFERRED_ON_HF,
        **{
            f"blocks.{{i}}.mlp.{site}": _NO_HF_ROUTER
            for site in ("hook_router_logits", "hook_expert_weights", "hook_expert_indices")
        },
    },
)
_STABLELM = replace(_LLAMA, residual_pair=False)
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
    lm_head="lm_head",
    qkv="c_attn",
    o_proj="c_proj",
    rotary=None,
    gate_up=None,
    fc_in="c_fc",
    down="c_proj",
)

# The families below pass one residual-stream tensor between layers, like GPT-2; their
# rows start from it.
_GPTJ = replace(
    _GPT2,
    pos_embed=None,
    ln2=None,
    layer_input=1,
    qkv="qkv_proj",
    o_proj="out_proj",
    rotary="rotary_emb",
    fc_in="fc_in",
    down="fc_out",
)
_OPT = replace(
    _GPT2,
    inner="model.decoder",
    embed="embed_tokens",
    pos_embed="embed_positions",
    layers="layers",
    final_norm="final_layer_norm",
    ln1="self_attn_layer_norm",
    attn="self_attn",
    ln2="final_layer_norm",
    mlp="",
    qkv="qkv_proj",
    o_proj="out_proj",
    fc_in="fc1",
    down="fc2",
)
_BLOOM = replace(
    _GPT2,
    embed="word_embeddings",
    pos_embed=None,
    embed_norm="word_embeddings_layernorm",
    ln1="input_layernorm",
    attn="self_attention",
    ln2="post_attention_layernorm",
    layer_input=1,
    # vLLM repacks BLOOM's per-head fused projection into [q | k | v] when it loads.
    qkv="query_key_value",
    o_proj="dense",
    fc_in="dense_h_to_4h",
    down="dense_4h_to_h",
    # BLOOM's GELU is the tanh approximation (transformers' BloomGelu, Megatron's bias-GELU);
    # vLLM 0.32's BloomMLP uses the exact (erf) GELU, 1e-3 away on the tiny model.
    activation=("gelu_impl", "gelu_pytorch_tanh"),
)
_FALCON = replace(
    _BLOOM,
    embed_norm=None,
    activation=None,
    attn="self_attention",
    ln1="input_layernorm",
    ln2=None,
    rotary="rotary_emb",
    partial_outputs=True,
    vllm_requires={
        "bias": (
            False,
            "vLLM's Falcon adds the projections' biases after the block's single "
            "all-reduce, outside the attention and MLP modules' outputs",
        ),
    },
)
#: vLLM architecture name -> layout of vLLM's own model class. Every entry is covered by the
#: parity tests, and its family is described in ``tl_core.architecture``. Architectures vLLM
#: runs on its Transformers backend (GPT-NeoX, OLMo 2, ...) have no row: their layout is read
#: from the hf driver's adapter (``_derive``, the ``transformers-backend`` extra).
FAMILY_LAYOUTS: dict[str, Layout] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _QWEN3,
    "Phi3ForCausalLM": _LLAMA,
    "MixtralForCausalLM": _MIXTRAL,
    "Qwen2MoeForCausalLM": _QWEN2_MOE,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
    "OlmoeForCausalLM": _OLMOE,
    "GraniteMoeForCausalLM": _GRANITE_MOE,
    "GptOssForCausalLM": _GPT_OSS,
    "Exaone4ForCausalLM": _EXAONE4,
    "GemmaForCausalLM": _LLAMA,
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA3,
    "StableLmForCausalLM": _STABLELM,
    "GPT2LMHeadModel": _GPT2,
    "GPTJForCausalLM": _GPTJ,
    "OPTForCausalLM": _OPT,
    "BloomForCausalLM": _BLOOM,
    "FalconForCausalLM": _FALCON,
}

#: Architectures vLLM 0.32 cannot run at all, with the reason (named when one is refused).
NOT_RUN_BY_VLLM: dict[str, str] = {
    "GPTNeoForCausalLM": (
        "vLLM 0.32 has no GPT-Neo model, and its Transformers backend cannot run one either: "
        "GPT-Neo computes attention inside its own module instead of calling transformers' "
        "attention interface"
    ),
}


def architecture_of(config: Any) -> str:
    """A checkpoint's ``architectures[0]`` (``"<none>"`` when its config names none)."""
    return str((getattr(config, "architectures", None) or ["<none>"])[0])


def layout_for(architecture: str) -> Layout:
    """The layout of a supported architecture.

    Args:
        architecture: The checkpoint's ``architectures[0]`` (``"LlamaForCausalLM"``).

    Returns:
        Its layout.

    Raises:
        ConfigError: The architecture is not supported, naming the supported ones (and
            why, where vLLM itself cannot run it).
    """
    layout = FAMILY_LAYOUTS.get(architecture)
    if layout is None:
        why = NOT_RUN_BY_VLLM.get(architecture)
        if why is not None:
            raise ConfigError(
                f"the vllm driver cannot serve architecture {architecture!r}: {why}. Use the "
                "hf driver for it."
            )
        raise ConfigError(
            f"the vllm driver has no row for vLLM's own {architecture!r} model class; rows: "
            f"{', '.join(sorted(FAMILY_LAYOUTS))}. Other architectures run on vLLM's Transformers "
            "backend, placed by the hf driver's description (tl_driver_vllm._driver_side._derive)."
        )
    return layout


def family_for(architecture: str) -> tuple[Layout, FamilyDescription]:
    """The layout of a supported architecture and its family's description.

    Raises:
        ConfigError: The architecture is not supported (``layout_for``), or its row and its
            description disagree (a table bug, named).
    """
    layout = layout_for(architecture)
    description = family_description(architectures=(architecture,))
    if description is None:
        raise ConfigError(
            f"the vllm driver's row for {architecture!r} names no family description in "
            "tl_core.architecture (docs/adding-a-family.md)"
        )
    problems = disagreements(layout, description)
    if problems:
        raise ConfigError(
            f"the vllm driver's row for {architecture!r} disagrees with the "
            f"{description.family!r} description: {'; '.join(problems)}"
        )
    return layout, description


def disagreements(layout: Layout, description: FamilyDescription) -> list[str]:
    """Where a row's paths say something else than its description (empty: they agree)."""
    d = description
    expected: dict[str, bool] = {
        "ln1": d.norm_before_attn,
        "ln2": d.norm_before_mlp,
        "ln1_post": d.norm_after_attn,
        "ln2_post": d.norm_after_mlp,
        "q_norm": d.qk_norm != "none",
        "k_norm": d.qk_norm != "none",
        "pos_embed": d.positions == "learned",
        "embed_norm": d.norm_after_embed,
        "router": d.moe,
        "gate_up": d.gated,
        "fc_in": d.mlp_variant == "dense",
    }
    if not layout.batched:  # the Transformers backend names the model's rotary module
        expected["rotary"] = d.rotary
    problems = [
        f"{name}={getattr(layout, name)!r} but the description says "
        f"{'there is one' if want else 'there is none'}"
        for name, want in expected.items()
        if (getattr(layout, name) is not None) != want
    ]
    if d.norm_before_unembed is not True:
        problems.append(f"final_norm={layout.final_norm!r} but the description has none")
    if layout.q_norm is not None and (layout.qk_norm_layout == "flat") != (
        d.qk_norm == "across_heads"
    ):
        problems.append(
            f"qk_norm_layout={layout.qk_norm_layout!r} but the description's QK-norm is "
            f"{d.qk_norm.replace('_', ' ')}"
        )
    return problems


def resolve(config: Any) -> tuple[Layout, FamilyDescription]:
    """The layout serving one checkpoint, and its family's description settled for it.

    Args:
        config: The checkpoint's ``transformers`` config (text config for wrappers).

    Raises:
        ConfigError: Unsupported architecture, or a config the family or vLLM's class
            cannot serve (naming each field, the value expected and why).
    """
    layout, description = family_for(architecture_of(config))
    return layout, settle(layout, description, config)


def settle(layout: Layout, description: FamilyDescription, config: Any) -> FamilyDescription:
    """``description`` settled for one checkpoint (``FamilyDescription.settled``), after
    checking that both the description and vLLM's class serve it.

    Raises:
        ConfigError: A config the description does not describe or vLLM's class cannot run
            (naming each field, the value expected and why).
    """
    problems = description.config_problems(config) + layout.config_problems(config)
    if problems:
        raise ConfigError(
            f"the vllm driver cannot serve this {architecture_of(config)!r} checkpoint: "
            f"{'; '.join(problems)}. Use the hf driver for it."
        )
    return description.settled(config)


def model_info(
    config: Any, description: FamilyDescription, *, max_model_len: int | None = None
) -> ModelInfo:
    """Build the ``ModelInfo`` of a checkpoint from its ``transformers`` config.

    The structure is the family's description, as on the hf driver, so a name resolves to
    the same site on both drivers.

    Args:
        config: A ``transformers.PretrainedConfig`` (text config for multimodal wrappers).
        description: Its family's description (``resolve``).
        max_model_len: The engine's context limit, when known (else the config's).

    Returns:
        Sizes from tl-core's config reader, structure from the description.

    Raises:
        ConfigError: A config missing a size, or one vLLM would read otherwise than
            transformers.
    """
    architecture = architecture_of(config)
    info = description.model_info(config, n_ctx=max_model_len, architecture=architecture)
    kv, multi_query = (
        getattr(config, "num_key_value_heads", None),
        getattr(config, "multi_query", None),
    )
    if isinstance(multi_query, bool) and isinstance(kv, int):
        # GPT-BigCode: transformers takes the key/value heads from multi_query alone, vLLM
        # from num_key_value_heads.
        heads = 1 if multi_query else info.n_heads
        if kv != heads:
            raise ConfigError(
                f"{architecture}: the config says multi_query={multi_query} ({heads} key/value "
                f"head{'s' if heads > 1 else ''}, as transformers computes it) but "
                f"num_key_value_heads={kv}, which vLLM reads instead, so the two would compute "
                f"different models; set num_key_value_heads to {heads} in the checkpoint's "
                f"config.json"
            )
    return info
