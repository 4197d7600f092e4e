"""Why a model lacks a canonical hook: reasons derived from the vocabulary's ``requires``."""

from __future__ import annotations

from collections.abc import Collection

from tl_core._model_info import ModelInfo
from tl_core._vocabulary import CANONICAL_TEMPLATES

__all__ = ["absent_hook_reasons"]

_REASONS = {
    "standard_pos": "the model has no learned position embedding (positions enter through "
    "rotary q/k or not at all)",
    "rotary": "the model has no rotary embedding, so q/k are never rotated",
    "gated_mlp": "the MLP is not gated, so there is no separate linear branch",
    "sequential": "attention and MLP read the same block input (parallel block), so there "
    "is no residual stream between them",
    "sandwich_norm": "the model has no norm after each sublayer (no sandwich norms)",
    "attn_result": "per-head results are opt-in: boot with use_attn_result=True",
    "norm": "the model has no normalisation layers",
}


def absent_hook_reasons(info: ModelInfo, present: Collection[str]) -> dict[str, str]:
    """Every canonical hook of a model this deep that is not in ``present``, with the reason."""
    reasons: dict[str, str] = {}
    for template in CANONICAL_TEMPLATES:
        names = (
            [template.template.format(i=i) for i in range(info.n_layers)]
            if "{i}" in template.template
            else [template.template]
        )
        for name in names:
            if name not in present:
                reasons[name] = _REASONS.get(
                    template.requires or "", "this model does not compute it"
                )
    return reasons
