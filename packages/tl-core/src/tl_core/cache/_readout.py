"""``ModelReadout``: the final norm and unembedding, for analysis done outside the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["ModelReadout"]


@dataclass(frozen=True)
class ModelReadout:
    """Weights that map a residual-stream vector to logits.

    ``logits = norm(x) @ W_U + b_U`` where ``norm`` is the final LayerNorm/RMSNorm with
    ``ln_final_weight``/``ln_final_bias`` (``None`` = identity / zero).

    Attributes:
        W_U: Unembedding, ``[d_model, d_vocab]``.
        b_U: Unembedding bias, ``[d_vocab]``, or ``None``.
        ln_final_weight: Final norm weight ``[d_model]`` or ``None`` (no weight).
        ln_final_bias: Final norm bias ``[d_model]`` or ``None``.
        normalization_type: ``"LN"``, ``"RMS"`` or ``None`` (no final norm).
        eps: The final norm's epsilon.
        logit_softcap: Final-logit soft-capping (Gemma 2), or ``None``.
    """

    W_U: torch.Tensor
    b_U: torch.Tensor | None
    ln_final_weight: torch.Tensor | None
    ln_final_bias: torch.Tensor | None
    normalization_type: Literal["LN", "RMS"] | None
    eps: float = 1e-5
    logit_softcap: float | None = None
