"""``FamilyDescription``: every engine-independent fact of one model family, and the rules
derived from them, written once.

A description says what a family is, never where an engine keeps its modules: which norm
kind it uses and where its norms sit, whether attention and the MLP run in parallel (and the
config field that decides it per checkpoint), its position scheme, embedding scale and norm,
QK-norm, MLP variant and routing, soft-caps, and the configs it cannot describe (with the
reason). Drivers keep their module paths in rows of their own that refer to a description;
every rule a driver needs from these facts (``model_info``, ``config_problems``,
``is_parallel``, ``sandwich``, ``block_form``, ``absent_templates``, ``architecture``) is a
method here, so two drivers cannot derive different answers from one family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tl_core.architecture._config import model_info_from_config
from tl_core.architecture._description import (
    Architecture,
    StackDescription,
    block_form,
    describe_model,
)
from tl_core.architecture._vocabulary import (
    NORM_KINDS,
    UNKNOWN,
    BlockForm,
    MLPVariant,
    ModelKind,
    NormKind,
    PositionScheme,
    QKNorm,
    Unknown,
    normalization_type,
)
from tl_core.hooks._model_info import ModelInfo

__all__ = ["BlockContents", "FamilyDescription"]

#: What tl reads inside a block: attention and an MLP (``"attention_mlp"``), one state-space
#: mixer behind a norm (``"mixer"``), or nothing (``"opaque"``: input and output only).
BlockContents = Literal["attention_mlp", "mixer", "opaque"]

_POSITIONS: dict[str, Literal["standard", "rotary", "none", "unknown"]] = {
    "learned": "standard",
    "rotary": "rotary",
    "alibi": "none",  # ALiBi adds a score bias inside attention: no position site
    "none": "none",
    "unknown": "unknown",
}
_NORM_SUFFIXES = ("hook_in", "hook_scale", "hook_normalized", "hook_out")


@dataclass(frozen=True)
class FamilyDescription:
    """What one model family is, independent of the engine that runs it.

    Per-checkpoint facts are read from the config by the methods (``is_parallel``,
    ``renormalizes``, ``model_info``, ``architecture``); ``settled`` fixes them for one
    checkpoint. ``dataclasses.replace`` derives a variant (a custom family, a test's wrong
    description).

    Attributes:
        family: Short family name (``"llama"``); shown in listings and errors, and the key
            drivers' rows refer to.
        model_types: The ``config.model_type`` values of the family.
        architectures: Class names of the family (``config.architectures``).
        kind: What the model is for (``ModelKind``).
        stacks: Its stacks of blocks, each with its attention direction.
        norm: How every norm normalizes and applies its weight (``NormKind``), ``None``
            for a family without norms, or ``"unknown"``.
        norm_before_attn: Whether attention reads a norm of the block input (``ln1``).
        norm_before_mlp: Whether the MLP has a norm of its own before it (``ln2``); in a
            parallel block ``False`` with ``norm_before_attn`` means one norm feeds both.
        norm_after_attn: Whether attention's output is normalised before it is added
            (``ln1_post``).
        norm_after_mlp: Whether the MLP's output is normalised before it is added
            (``ln2_post``). The hook vocabulary names both post-norms or neither, so a
            description with only one is refused.
        norm_after_residual: Whether each sublayer's output is added to its input and the
            sum normalised, the original Transformer's post-LN (BERT): ``h = ln1(x +
            attn(x)); out = ln2(h + mlp(h))``. ``ln1`` and ``ln2`` then name these two
            norms, and no norm sits before a sublayer or on its output alone.
        norm_after_embed: Whether a norm sits between the embedding and the first block
            (BLOOM).
        head_transform: Whether the unembedding reads a transform of the last block's output
            (a masked LM's head: dense, activation, then the final norm).
        token_types: Whether a token-type (segment) embedding adds a row per segment id to
            the token embedding (BERT).
        norm_before_unembed: Whether a norm sits between the last block and the
            unembedding (the final norm), or ``"unknown"``.
        parallel: Whether attention and the MLP read the same block input.
        parallel_field: Config field that decides ``parallel`` per checkpoint, if any.
        positions: Where positions enter (``PositionScheme``).
        embed_scaled: Whether the embedding is multiplied by ``sqrt(d_model)`` (Gemma).
        qk_norm: Whether and how queries and keys are normalised (``QKNorm``).
        mlp_variant: ``"dense"``, ``"gated"`` or ``"moe"``.
        renormalize: Whether a mixture of experts renormalises its top-k weights to sum
            to 1 (after the softmax over every expert).
        renormalize_field: Config field that decides ``renormalize`` per checkpoint
            (``norm_topk_prob``), if any.
        sinks: Whether attention adds a learned sink logit per head (gpt-oss).
        attn_softcap: Config field of the attention-logit soft-cap, if any.
        final_softcap: Config field of the final-logit soft-cap, if any.
        blocks: What tl reads inside a block (``BlockContents``).
        inferred: Whether the description was inferred from a model (nobody wrote it).
        config_requires: Config values the description assumes, ``{field: (value,
            reason)}``: a checkpoint with another value is refused by every driver.
        same_width: ``(config field, reason)``: a width that must equal ``hidden_size``.
        hub_patterns: Regular expressions matching hub ids of the family.
        known_models: Hub ids of well-known checkpoints of the family.
    """

    family: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    kind: ModelKind = "causal_lm"
    stacks: tuple[StackDescription, ...] = (StackDescription(),)
    norm: NormKind | Unknown | None = "rms"
    norm_before_attn: bool = True
    norm_before_mlp: bool = True
    norm_after_attn: bool = False
    norm_after_mlp: bool = False
    norm_after_residual: bool = False
    norm_after_embed: bool = False
    token_types: bool = False
    head_transform: bool = False
    norm_before_unembed: bool | Unknown = True
    parallel: bool = False
    parallel_field: str | None = None
    positions: PositionScheme = "rotary"
    embed_scaled: bool = False
    qk_norm: QKNorm = "none"
    mlp_variant: MLPVariant = "gated"
    renormalize: bool = True
    renormalize_field: str | None = None
    sinks: bool = False
    attn_softcap: str | None = None
    final_softcap: str | None = None
    blocks: BlockContents = "attention_mlp"
    inferred: bool = False
    config_requires: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    same_width: tuple[str, str] | None = None
    hub_patterns: tuple[str, ...] = ()
    known_models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if self.blocks == "attention_mlp" and self.norm_after_attn != self.norm_after_mlp:
            problems.append(
                "a norm after only one sublayer: the hook vocabulary names a norm after each "
                "sublayer (ln1_post and ln2_post) or after neither"
            )
        if self.norm not in (*NORM_KINDS, None, UNKNOWN):
            problems.append(f"norm {self.norm!r} is none of {NORM_KINDS}, None or 'unknown'")
        if self.norm is None and (
            self.norm_before_attn or self.norm_before_mlp or self.norm_after_attn
        ):
            problems.append("norm=None (no norms) but a norm sits in the block")
        if self.norm_after_residual and (
            self.norm is None
            or self.parallel
            or self.norm_before_attn
            or self.norm_before_mlp
            or self.sandwich
        ):
            problems.append(
                "norm_after_residual (each residual sum normalised, BERT) with no norms, "
                "parallel sublayers or another norm placement: its ln1 and ln2 are the two "
                "norms after the residual adds, and a block has no others"
            )
        if problems:
            raise ValueError(f"FamilyDescription {self.family!r}: {'; '.join(problems)}")

    # -- per-checkpoint facts ---------------------------------------------------------

    def is_parallel(self, config: Any) -> bool:
        """Whether attention and the MLP read the same block input in this checkpoint."""
        if self.parallel_field is not None:
            return bool(getattr(config, self.parallel_field, self.parallel))
        return self.parallel

    def renormalizes(self, config: Any) -> bool:
        """Whether this checkpoint's router renormalises its top-k weights."""
        if self.renormalize_field is not None:
            return bool(getattr(config, self.renormalize_field, self.renormalize))
        return self.renormalize

    def config_problems(self, config: Any) -> list[str]:
        """Why this description does not describe ``config`` (empty when it does)."""
        problems = [
            f"{name}={getattr(config, name, None)!r} (expected {want!r}): {why}"
            for name, (want, why) in self.config_requires.items()
            if getattr(config, name, want) != want
        ]
        if self.same_width is not None:
            name, why = self.same_width
            width, hidden = getattr(config, name, None), getattr(config, "hidden_size", None)
            if width is not None and width != hidden:
                problems.append(f"{name}={width!r} (expected hidden_size={hidden!r}): {why}")
        return problems

    def settled(self, config: Any) -> FamilyDescription:
        """This description with every per-checkpoint choice read from ``config``
        (``parallel``, ``renormalize``), so it can travel without the config."""
        return dataclasses.replace(
            self,
            parallel=self.is_parallel(config),
            parallel_field=None,
            renormalize=self.renormalizes(config),
            renormalize_field=None,
        )

    # -- derived rules ----------------------------------------------------------------

    @property
    def sandwich(self) -> bool:
        """Whether each sublayer's output is normalised before it joins the residual stream
        (Gemma 2/3's sandwich, OLMo 2's post-norm): then ``ln1_post.*`` and ``ln2_post.*``
        exist, and ``hook_attn_out``/``hook_mlp_out`` name the post-norm outputs."""
        return self.norm_after_attn and self.norm_after_mlp

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate (``mlp.hook_pre_linear`` exists)."""
        return self.mlp_variant == "gated"

    @property
    def moe(self) -> bool:
        """Whether the MLP is a mixture of experts (no single layer of neurons)."""
        return self.mlp_variant == "moe"

    @property
    def rotary(self) -> bool:
        """Whether queries and keys are rotated inside attention."""
        return self.positions == "rotary"

    @property
    def norm_kind(self) -> NormKind:
        """The norms' kind, for code that recomputes a norm.

        Raises:
            ValueError: The family has no norms, or tl did not establish their kind.
        """
        if self.norm is None or self.norm == UNKNOWN:
            raise ValueError(f"{self.family!r} has no norm kind tl knows (norm={self.norm!r})")
        return self.norm

    def block_form(self, config: Any = None) -> BlockForm:
        """How a block of this checkpoint combines its sublayers (``BlockForm``)."""
        return block_form(
            parallel=self.is_parallel(config),
            norm_before_attn=self.norm_before_attn,
            norm_before_mlp=self.norm_before_mlp,
            norms_after=self.sandwich,
            opaque=self.blocks == "opaque",
            mixer=self.blocks == "mixer",
            residual_normed=self.norm_after_residual,
        )

    def model_info(
        self, config: Any, *, n_ctx: int | None = None, architecture: str | None = None
    ) -> ModelInfo:
        """The ``ModelInfo`` of a checkpoint of this family.

        Args:
            config: A ``transformers`` config (text config for wrappers), or anything with
                its attributes.
            n_ctx: The longest input (default: the config's position limit).
            architecture: The class name to report (default: ``config.architectures[0]``,
                else the family's first).

        Returns:
            Sizes from the config (``model_info_from_config``), structure from this
            description.

        Raises:
            ConfigError: The config lacks the layer count, width or head count.
        """
        named = getattr(config, "architectures", None) or [self.architectures[0]]
        info = model_info_from_config(
            config,
            normalization_type=None if self.norm is None else normalization_type(self.norm),
            positional_embedding_type=_POSITIONS[self.positions],
            gated_mlp=self.gated,
            parallel_attn_mlp=self.is_parallel(config),
            sandwich_norm=self.sandwich,
            post_residual_norm=self.norm_after_residual and self.blocks == "attention_mlp",
            qk_norm=self.qk_norm != "none",
            embed_norm=self.norm_after_embed,
            token_type_embed=self.token_types,
            head_transform=self.head_transform,
            moe=self.moe,
            architecture=architecture or str(named[0]),
            n_ctx=n_ctx,
        )
        shared = getattr(config, "shared_expert_intermediate_size", None) if self.moe else None
        if isinstance(shared, int) and not isinstance(shared, bool) and shared > 0:
            info = dataclasses.replace(info, d_shared_expert=shared)  # Qwen2-MoE
        if self.blocks == "mixer":
            info = dataclasses.replace(info, mixer=True)
        return info

    def architecture(self, config: Any, info: ModelInfo) -> Architecture:
        """This description read against one checkpoint: its ``Architecture``.

        Args:
            config: The checkpoint's ``transformers`` config (text config for wrappers).
            info: The driver's ``ModelInfo`` of it (``model_info``, or the driver's own for
                an inferred description).
        """
        return describe_model(
            config,
            info,
            norm=self.norm,
            block=self.block_form(config),
            qk_norm=self.qk_norm,
            embed_scaled=self.embed_scaled,
            final_norm=self.norm_before_unembed,
            sinks=self.sinks,
            kind=self.kind,
            stacks=self.stacks,
        )

    def absent_templates(self) -> dict[str, str]:
        """Hook templates this family lacks although its ``ModelInfo`` suggests them (a norm
        the block does not have, neurons a mixture of experts does not have), with the
        reason. A driver adds what its own engine cannot serve."""
        reasons: dict[str, str] = {}
        if self.blocks != "attention_mlp":
            return reasons
        suffixes: tuple[str, ...]
        # Post-LN blocks (BERT) have ln1 and ln2: the norms after the residual adds.
        if not self.norm_before_attn and not self.norm_after_residual:
            why = (
                f"{self.family} has no norm before attention (attention reads the residual "
                "stream directly)"
            )
            reasons.update({f"blocks.{{i}}.ln1.{s}": why for s in _NORM_SUFFIXES})
        if not self.norm_before_mlp and not self.norm_after_residual:
            suffixes = _NORM_SUFFIXES[1:]
            if self.parallel and self.norm_before_attn:
                why = (
                    f"{self.family} has one norm per block feeding both attention and the MLP; "
                    "it is served as ln1.* (ln1.hook_out is also the MLP's input, "
                    "mlp.hook_in); ln2.hook_in is the block input as the MLP's copy of that "
                    "norm reads it, so an edit there reaches the MLP only"
                )
            else:
                why = (
                    f"{self.family} has no norm before the MLP (the MLP reads the residual "
                    "stream directly)"
                )
                # A parallel block without norms has no input of a norm before the MLP;
                # a sequential one has (resid_mid, served as ln2.hook_in).
                suffixes = _NORM_SUFFIXES if self.parallel else suffixes
            reasons.update({f"blocks.{{i}}.ln2.{s}": why for s in suffixes})
        if self.moe:
            why = (
                f"{self.family} routes each token through a few of its experts, so there is no "
                "single layer of MLP neurons; use mlp.hook_in / mlp.hook_out"
            )
            reasons.update(
                {f"blocks.{{i}}.mlp.{s}": why for s in ("hook_pre", "hook_pre_linear", "hook_post")}
            )
        return reasons

    # -- transport --------------------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for a process boundary that carries no Python objects);
        ``from_dict`` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FamilyDescription:
        """The description ``as_dict`` wrote (lists read back as tuples).

        Raises:
            TypeError: ``data`` names a field the description does not have.
        """
        values = dict(data)
        values["stacks"] = tuple(StackDescription(**s) for s in values.get("stacks", ()))
        for key in ("model_types", "architectures", "hub_patterns", "known_models"):
            if key in values:
                values[key] = tuple(values[key])
        if values.get("same_width") is not None:
            values["same_width"] = tuple(values["same_width"])
        values["config_requires"] = {
            k: tuple(v) for k, v in dict(values.get("config_requires", {})).items()
        }
        return cls(**values)
