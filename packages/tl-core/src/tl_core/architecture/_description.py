"""``Architecture``: one engine-independent description of a checkpoint's structure.

What a driver reports about the model it booted, whatever its engine calls the modules: how a
block combines attention and MLP, each norm's kind and epsilon, the position scheme,
attention's variant, the MLP's variant, the unembedding. It is the family's description
(``FamilyDescription``) read against one checkpoint's config: the facts a config states
(window sizes, soft-caps, expert counts, multipliers) are read here once, so every driver
serving the same checkpoint reports the same description. Certification reports it;
``bridge.architecture`` holds it. A fact tl did not establish is ``"unknown"``.

Duck-typed over the config: tl-core does not import transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from tl_core.architecture._config import first_set as _first
from tl_core.architecture._vocabulary import (
    UNKNOWN,
    AttentionDirection,
    AttentionVariant,
    BlockForm,
    MLPVariant,
    ModelKind,
    NormKind,
    PositionScheme,
    QKNorm,
    Unknown,
)
from tl_core.hooks._model_info import ModelInfo

__all__ = [
    "Architecture",
    "AttentionDescription",
    "MLPDescription",
    "NormDescription",
    "StackDescription",
    "VisionDescription",
    "block_form",
    "describe_model",
    "uses_alibi",
]

# Config field names, in the order families use them.
_EPS = (
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "norm_epsilon",
    "rms_norm_epsilon",
    "norm_eps",
)
_ATTN_SOFTCAP = ("attn_logit_softcapping",)
_FINAL_SOFTCAP = ("final_logit_softcapping",)
# Scalar multipliers some families apply outside their modules (Granite, Cohere, MiniCPM).
_MULTIPLIERS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "logit_scale",
)


@dataclass(frozen=True)
class NormDescription:
    """Every norm of the model (tl-core's one norm vocabulary).

    Attributes:
        kind: How it normalizes and applies its weight (``tl_core.architecture.NormKind``),
            ``None`` for a model without norms, or ``"unknown"`` where tl did not establish
            it (blocks it reads from outside only, with no final norm it could measure).
        eps: The epsilon the config declares, or ``None`` where it declares none (drivers
            then read or measure it on the module, ``norm_module_eps``).
    """

    kind: NormKind | Unknown | None
    eps: float | None


@dataclass(frozen=True)
class StackDescription:
    """One stack of blocks and how its attention reads positions.

    A causal LM has one, ``"blocks"``; an encoder-decoder will have an encoder and a decoder
    stack, a vision-language model a vision tower beside its language stack.

    Attributes:
        name: The hook prefix of its blocks (``"blocks"`` -> ``blocks.{i}.*``).
        attention: Which positions its attention reads (``AttentionDirection``).
    """

    name: str = "blocks"
    attention: AttentionDirection = "causal"


@dataclass(frozen=True)
class VisionDescription:
    """How images reach the language stack of a vision-language model.

    A vision tower reads the pixels, a projector maps its features to ``d_model``, and the
    projected features replace the embeddings at the positions of the image token: one image
    fills ``tokens_per_image`` consecutive positions of the prompt.

    Attributes:
        tower: The vision tower's model type (``"clip_vision_model"``).
        image_size: ``(height, width)`` of the pixels the tower takes.
        channels: Colour channels of the pixels.
        image_token_id: The token id whose positions receive the image features.
        tokens_per_image: Positions one image fills, or ``"unknown"`` where tl did not
            measure it (a model booted without weights).
    """

    tower: str
    image_size: tuple[int, int]
    channels: int
    image_token_id: int
    tokens_per_image: int | Unknown


@dataclass(frozen=True)
class AttentionDescription:
    """Attention, as every layer of the model runs it.

    Attributes:
        variant: ``"mha"`` (a key/value head per query head), ``"gqa"`` (grouped),
            ``"mqa"`` (one key/value head) or ``"mla"`` (multi-head latent attention: keys
            and values decompressed from a shared latent, DeepSeek-V2/V3).
        n_heads: Query heads.
        n_kv_heads: Key/value heads.
        d_head: Width of one head.
        qk_norm: Whether and how queries and keys are normalised (``QKNorm``).
        window: The sliding window in tokens, or ``None`` when no layer has one.
        windowed_layers: The layers that attend within ``window`` (the others see the
            whole prefix).
        sinks: Whether each head adds a learned sink logit (patterns sum to less than 1).
        softcap: The attention-logit soft-cap, or ``None``.
        d_q_latent: Width of the compressed query latent (``"mla"``), or ``None``.
        d_kv_latent: Width of the compressed key/value latent (``"mla"``), or ``None``.
    """

    variant: AttentionVariant
    n_heads: int
    n_kv_heads: int
    d_head: int
    qk_norm: QKNorm
    window: int | None
    windowed_layers: tuple[int, ...]
    sinks: bool
    softcap: float | None
    d_q_latent: int | None = None
    d_kv_latent: int | None = None


@dataclass(frozen=True)
class MLPDescription:
    """The MLP (or mixture of experts) of the blocks.

    Attributes:
        variant: ``"dense"`` (``down(act(in(x)))``), ``"gated"`` (``down(act(gate(x)) *
            up(x))``) or ``"moe"`` (a router picks experts per token).
        d_mlp: Hidden width (per expert for a mixture of experts).
        act_fn: The activation as the config names it, or ``None``.
        n_experts: Routed experts per layer (``None`` for a dense MLP).
        experts_per_token: Experts each token is routed to.
        d_shared_expert: Hidden width of the shared expert every token runs, or ``None``.
        dense_layers: Layers of a mixture-of-experts model whose MLP is dense (DeepSeek's
            first ``k``, Qwen-MoE's ``mlp_only_layers``, a sparse step above 1).
    """

    variant: MLPVariant
    d_mlp: int
    act_fn: str | None
    n_experts: int | None = None
    experts_per_token: int | None = None
    d_shared_expert: int | None = None
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Architecture:
    """What a checkpoint is, independent of the engine that runs it.

    Attributes:
        name: The class name (``config.architectures[0]``).
        n_layers: Decoder blocks.
        d_model: Residual-stream width.
        block: How a block combines attention and MLP (``BlockForm``).
        norm: The norms' kind and epsilon.
        positions: ``"learned"``, ``"rotary"``, ``"alibi"``, ``"none"`` or ``"unknown"``.
        rotary_fraction: Share of each head that is rotated (``None`` without rotary).
        embed_scaled: Whether the embedding is multiplied by ``sqrt(d_model)`` (Gemma).
        embed_norm: Whether a norm sits between the embedding and the first block (BLOOM).
        attention: Attention's variant (``None`` for opaque blocks).
        mlp: The MLP's variant (``None`` for opaque blocks).
        final_norm: Whether a norm sits between the last block and the unembedding, or
            ``"unknown"`` (an opaque block may end in one; a head transform may hold one).
        tied_embeddings: Whether the unembedding is the token embedding's matrix.
        logit_softcap: The final-logit soft-cap, or ``None``.
        multipliers: Scalar multipliers the config applies outside the modules
            (``("embedding_multiplier", 12.0)``, Granite), as ``(field, value)`` pairs.
        kind: What the model is for (``ModelKind``: ``"causal_lm"``).
        stacks: Its stacks of blocks (one ``"blocks"`` stack, causal, for a causal LM).
        vision: How images reach the language stack (``VisionDescription``), or ``None``
            for a model that reads no images.
    """

    name: str
    n_layers: int
    d_model: int
    block: BlockForm
    norm: NormDescription
    positions: PositionScheme
    rotary_fraction: float | None
    embed_scaled: bool
    embed_norm: bool
    attention: AttentionDescription | None
    mlp: MLPDescription | None
    final_norm: bool | Unknown
    tied_embeddings: bool
    logit_softcap: float | None
    multipliers: tuple[tuple[str, float], ...] = ()
    kind: ModelKind = "causal_lm"
    stacks: tuple[StackDescription, ...] = (StackDescription(),)
    vision: VisionDescription | None = None

    def facts(self) -> dict[str, str]:
        """The description as report lines (``{"block": "sequential, rms norms (eps 1e-05)"}``)."""
        if self.norm.kind == UNKNOWN:
            norm = "norms unknown"
        else:
            norm = f"{self.norm.kind} norms" if self.norm.kind else "no norms"
        if self.norm.eps is not None:
            norm += f" (eps {self.norm.eps:g})"
        positions: str = self.positions
        if self.positions == "rotary" and self.rotary_fraction not in (None, 1.0):
            positions += f" on {self.rotary_fraction:g} of each head"
        embed = "scaled by sqrt(d_model)" if self.embed_scaled else "plain"
        if self.embed_norm:
            embed += ", then normalised"
        unembed = "tied to the embedding" if self.tied_embeddings else "own matrix"
        if self.final_norm == UNKNOWN:
            unembed += ", final norm unknown"
        elif not self.final_norm:
            unembed += ", no final norm"
        if self.logit_softcap is not None:
            unembed += f", soft-cap {self.logit_softcap:g}"
        stacks = ", ".join(f"{s.name} ({s.attention} attention)" for s in self.stacks)
        out = {
            "model": f"{self.kind.replace('_', ' ')}: {stacks}",
            "block": f"{self.block.replace('_', ' ')} ({self.n_layers} blocks, d_model {self.d_model}), {norm}",
            "embedding": embed,
            "positions": positions,
        }
        if self.attention is not None:
            out["attention"] = _attention_fact(self.attention)
        if self.mlp is not None:
            out["mlp"] = _mlp_fact(self.mlp)
        out["unembedding"] = unembed
        if self.vision is not None:
            out["images"] = _vision_fact(self.vision)
        if self.multipliers:
            out["multipliers"] = ", ".join(f"{k} {v:g}" for k, v in self.multipliers)
        return out

    def differences(self, other: Architecture) -> list[str]:
        """The facts on which ``other`` disagrees, as ``"path: mine != theirs"`` lines."""
        return _differences(self, other, "")


def _attention_fact(a: AttentionDescription) -> str:
    out = f"{a.variant}, {a.n_heads} heads / {a.n_kv_heads} key-value, d_head {a.d_head}"
    if a.d_kv_latent is not None:
        q = f"query {a.d_q_latent}, " if a.d_q_latent is not None else ""
        out += f", latents {q}key-value {a.d_kv_latent}"
    if a.qk_norm != "none":
        out += f", qk-norm {a.qk_norm.replace('_', ' ')}"
    if a.window is not None:
        out += f", window {a.window} on layers {_ranges(a.windowed_layers)}"
    if a.sinks:
        out += ", sinks"
    if a.softcap is not None:
        out += f", soft-cap {a.softcap:g}"
    return out


def _vision_fact(v: VisionDescription) -> str:
    height, width = v.image_size
    tokens = "an unmeasured number of" if v.tokens_per_image == UNKNOWN else str(v.tokens_per_image)
    return (
        f"{v.tower} tower on {v.channels} x {height} x {width} pixels; each image fills "
        f"{tokens} positions of token {v.image_token_id}"
    )


def _mlp_fact(m: MLPDescription) -> str:
    out = f"{m.variant}, d_mlp {m.d_mlp}" + (f", {m.act_fn}" if m.act_fn else "")
    if m.variant == "moe":
        out += f", top {m.experts_per_token} of {m.n_experts} experts"
        if m.d_shared_expert:
            out += f", shared expert {m.d_shared_expert}"
        if m.dense_layers:
            out += f", dense on layers {_ranges(m.dense_layers)}"
    return out


def _differences(a: Any, b: Any, prefix: str) -> list[str]:
    if is_dataclass(a) and is_dataclass(b) and type(a) is type(b):
        out: list[str] = []
        for f in fields(a):
            out += _differences(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} != {b!r}"]


def _ranges(layers: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(s) if s == e else f"{s}-{e}" for s, e in runs)


def block_form(
    *,
    parallel: bool,
    norm_before_attn: bool,
    norm_before_mlp: bool,
    norms_after: bool,
    opaque: bool = False,
    mixer: bool = False,
    residual_normed: bool = False,
) -> BlockForm:
    """The ``BlockForm`` of a block from where its norms sit.

    Args:
        parallel: Whether attention and MLP read the same block input.
        norm_before_attn: Whether attention reads a norm of its input.
        norm_before_mlp: Whether the MLP has a norm of its own before it (in a parallel
            block, ``False`` means it shares attention's).
        norms_after: Whether each sublayer's output is normalised before it is added.
        opaque: Whether tl reads the block only from outside.
        mixer: Whether the block is a state-space mixer behind a norm (Mamba).
        residual_normed: Whether each sublayer's residual sum is normalised (BERT's post-LN).
    """
    if mixer:
        return "mixer"
    if opaque:
        return "opaque"
    if residual_normed:
        return "post_residual_norm"
    if parallel:
        return "parallel" if norm_before_mlp else "parallel_shared_norm"
    if norms_after:
        return "sandwich" if norm_before_attn else "post_norm"
    return "sequential"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _windowed_layers(config: Any, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None, ()
    if getattr(config, "use_sliding_window", True) is False:
        return None, ()
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types:
        layers = tuple(i for i, t in enumerate(layer_types[:n_layers]) if "sliding" in str(t))
    else:
        layers = tuple(range(n_layers))
    return (window, layers) if layers else (None, ())


def _dense_layers(config: Any, n_layers: int) -> tuple[int, ...]:
    dense: set[int] = set()
    first = getattr(config, "first_k_dense_replace", None)
    if isinstance(first, int):
        dense.update(range(min(first, n_layers)))
    only = getattr(config, "mlp_only_layers", None)
    if isinstance(only, (list, tuple)):
        dense.update(i for i in only if isinstance(i, int) and 0 <= i < n_layers)
    step = getattr(config, "decoder_sparse_step", None)
    if isinstance(step, int) and step > 1:
        dense.update(i for i in range(n_layers) if (i + 1) % step != 0)
    return tuple(sorted(dense))


def uses_alibi(config: Any) -> bool:
    """Whether a config's attention scores carry ALiBi's additive position bias."""
    return bool(getattr(config, "alibi", False)) or getattr(config, "model_type", None) in (
        "bloom",
        "mpt",
    )


def describe_model(
    config: Any,
    info: ModelInfo,
    *,
    norm: NormKind | Unknown | None,
    block: BlockForm,
    qk_norm: QKNorm = "none",
    embed_scaled: bool = False,
    final_norm: bool | Unknown = True,
    sinks: bool = False,
    kind: ModelKind = "causal_lm",
    stacks: tuple[StackDescription, ...] = (StackDescription(),),
) -> Architecture:
    """The ``Architecture`` of a checkpoint from its config, its ``ModelInfo`` and the facts
    its description holds (``FamilyDescription.architecture`` passes them).

    Args:
        config: The checkpoint's ``transformers`` config (text config for wrappers).
        info: The driver's ``ModelInfo`` of it (sizes, gated or mixture-of-experts MLP).
        norm: The norms' kind, ``None`` when the model has none, or ``"unknown"``.
        block: How a block combines its sublayers (``block_form``).
        qk_norm: How queries and keys are normalised.
        embed_scaled: Whether the embedding is multiplied by ``sqrt(d_model)``.
        final_norm: Whether a norm precedes the unembedding, or ``"unknown"``.
        sinks: Whether attention adds a sink logit per head.
        kind: What the model is for.
        stacks: Its stacks of blocks.

    Returns:
        The description.
    """
    n_kv = info.kv_heads
    if getattr(config, "kv_lora_rank", None):
        variant: AttentionVariant = "mla"
    elif n_kv == info.n_heads:
        variant = "mha"
    else:
        variant = "mqa" if n_kv == 1 else "gqa"
    window, windowed = _windowed_layers(config, info.n_layers)
    attention: AttentionDescription | None = AttentionDescription(
        variant=variant,
        n_heads=info.n_heads,
        n_kv_heads=n_kv,
        d_head=info.d_head,
        qk_norm=qk_norm,
        window=window,
        windowed_layers=windowed,
        sinks=sinks,
        softcap=_number(_first(config, _ATTN_SOFTCAP)),
        d_q_latent=info.d_q_latent,
        d_kv_latent=info.d_kv_latent,
    )
    mlp: MLPDescription | None
    if info.n_experts:
        shared = info.d_shared_expert
        n_shared, width = (
            getattr(config, "n_shared_experts", None),
            getattr(config, "moe_intermediate_size", None),
        )
        if shared is None and isinstance(n_shared, int) and n_shared > 0 and isinstance(width, int):
            shared = n_shared * width  # DeepSeek: n shared experts run as one wider one
        expert_width = getattr(config, "moe_intermediate_size", None)
        mlp = MLPDescription(
            "moe", expert_width if isinstance(expert_width, int) else info.d_mlp, info.act_fn, info.n_experts, info.experts_per_token, shared,
            _dense_layers(config, info.n_layers),
        )  # fmt: skip
    else:
        mlp = MLPDescription("gated" if info.gated_mlp else "dense", info.d_mlp, info.act_fn)
    if block in ("opaque", "mixer"):
        attention = mlp = None
    if info.positional_embedding_type == "standard":
        positions: PositionScheme = "learned"
    elif info.positional_embedding_type == "rotary":
        positions = "rotary"
    elif info.positional_embedding_type == "unknown":
        positions = UNKNOWN
    else:
        positions = "alibi" if uses_alibi(config) else "none"
    eps = _number(_first(config, _EPS)) if norm not in (None, UNKNOWN) else None
    multipliers = tuple(
        (name, float(value))
        for name in _MULTIPLIERS
        if (value := _number(getattr(config, name, None))) is not None and value != 1.0
    )
    return Architecture(
        name=info.architecture,
        n_layers=info.n_layers,
        d_model=info.d_model,
        block=block,
        norm=NormDescription(norm, eps),
        positions=positions,
        rotary_fraction=(info.rotary_width / info.d_head) if positions == "rotary" else None,
        embed_scaled=embed_scaled,
        embed_norm=info.embed_norm,
        attention=attention,
        mlp=mlp,
        final_norm=final_norm,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        logit_softcap=_number(_first(config, _FINAL_SOFTCAP)),
        multipliers=multipliers,
        kind=kind,
        stacks=stacks,
    )
