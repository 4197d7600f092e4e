"""The words a description is written in: norm kinds, block forms, positions, kinds of model.

Plain ``Literal`` types and one sentinel, imported by every other module of the package and
by drivers' tables; importing them needs neither torch nor an engine.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "NORM_KINDS",
    "UNKNOWN",
    "AttentionDirection",
    "AttentionVariant",
    "BlockForm",
    "MLPVariant",
    "ModelKind",
    "NormKind",
    "PositionScheme",
    "QKNorm",
    "Unknown",
    "normalization_type",
]

#: A fact tl did not establish (an opaque block's norms, its position scheme): said as such,
#: never replaced by a default.
Unknown = Literal["unknown"]
#: The one value of ``Unknown``.
UNKNOWN: Final[Unknown] = "unknown"

#: How a norm normalizes and applies its weight (over the last axis):
#: ``"layernorm"``: centred, biased variance, ``normalized * w + b``;
#: ``"rms"``: ``w * normalized.to(input_dtype)`` (Llama);
#: ``"rms_weight_first"``: ``(w * normalized).to(input_dtype)`` (OLMo 2);
#: ``"rms_plus_one"``: ``(normalized * (1 + w)).to(input_dtype)`` (Gemma).
NormKind = Literal["layernorm", "rms", "rms_weight_first", "rms_plus_one"]
NORM_KINDS: tuple[NormKind, ...] = ("layernorm", "rms", "rms_weight_first", "rms_plus_one")
"""Every ``NormKind``."""

#: How a block combines its sublayers (``x`` the block input, ``n`` a norm):
#: ``"sequential"``: ``h = x + attn(n1(x)); out = h + mlp(n2(h))`` (Llama, GPT-2);
#: ``"parallel"``: ``out = x + attn(n1(x)) + mlp(n2(x))`` (GPT-NeoX);
#: ``"parallel_shared_norm"``: ``out = x + attn(n(x)) + mlp(n(x))`` (GPT-J, Falcon-7B, Phi);
#: ``"sandwich"``: sequential with a norm after each sublayer too (Gemma 2/3);
#: ``"post_norm"``: ``h = x + n1(attn(x)); out = h + n2(mlp(h))`` (OLMo 2, EXAONE 4);
#: ``"post_residual_norm"``: ``h = n1(x + attn(x)); out = n2(h + mlp(h))``, the original
#: Transformer's post-LN (BERT, RoBERTa, ELECTRA);
#: ``"mixer"``: ``out = x + mixer(n(x))``, a state-space mixer in place of attention and MLP (Mamba);
#: ``"opaque"``: a block tl does not read inside (hybrids and recurrent blocks).
BlockForm = Literal[
    "sequential",
    "parallel",
    "parallel_shared_norm",
    "sandwich",
    "post_norm",
    "post_residual_norm",
    "mixer",
    "opaque",
]

#: How queries and keys are normalised: ``"none"``; ``"per_head"`` (one scale per head and
#: position: Qwen3, Gemma 3); ``"across_heads"`` (all heads of a position together: OLMo 2).
QKNorm = Literal["none", "per_head", "across_heads"]

#: Where positions enter: a learned table added to the embedding, rotary q/k, ALiBi's score
#: bias, none at all, or ``"unknown"`` (an opaque block's, which tl does not read).
PositionScheme = Literal["learned", "rotary", "alibi", "none", "unknown"]
#: Attention's heads: one key/value head per query head (``"mha"``), grouped (``"gqa"``),
#: one for all (``"mqa"``), or multi-head latent attention (``"mla"``, DeepSeek-V2/V3).
AttentionVariant = Literal["mha", "gqa", "mqa", "mla"]
#: The MLP: ``down(act(in(x)))`` (``"dense"``), ``down(act(gate(x)) * up(x))`` (``"gated"``),
#: or a router choosing experts per token (``"moe"``).
MLPVariant = Literal["dense", "gated", "moe"]

#: What the model is for, which decides its stacks and head: a ``"causal_lm"`` (one decoder
#: stack, an unembedding predicting the next token) or a ``"masked_lm"`` (one encoder stack,
#: a head predicting each position's own token). Sequence-to-sequence and image-text-to-text
#: models add their kinds here.
ModelKind = Literal["causal_lm", "masked_lm"]

#: Which positions a stack's attention reads: ``"causal"`` (each position its prefix) or
#: ``"bidirectional"`` (every position of its prompt, as an encoder's). Prefix-LM stacks add
#: their direction here.
AttentionDirection = Literal["causal", "bidirectional"]


def normalization_type(kind: NormKind | Unknown) -> Literal["LN", "RMS", "unknown"]:
    """The ``ModelInfo.normalization_type`` of a norm kind (``"unknown"`` stays unknown)."""
    if kind == UNKNOWN:
        return UNKNOWN
    return "LN" if kind == "layernorm" else "RMS"
