"""``random_dictionary``: an untrained dictionary of any shape, for tests, demos and timing."""

from __future__ import annotations

from typing import Any

import torch

from tl_core._dictionaries._dictionary import SparseDictionary

__all__ = ["random_dictionary"]


def random_dictionary(
    d_in: int,
    d_sae: int,
    *,
    d_out: int | None = None,
    seed: int = 0,
    scale: float = 0.3,
    skip: bool = False,
    **settings: Any,
) -> SparseDictionary:
    """A dictionary with Gaussian weights (``scale`` their standard deviation, biases a
    third of it), reproducible from ``seed``.

    Args:
        d_in: Width it reads.
        d_sae: Number of features.
        d_out: Width it writes (default ``d_in``).
        seed: Seed of the weights.
        scale: Standard deviation of the matrices.
        skip: Give it a skip path ``W_skip`` (a skip transcoder; pass
            ``apply_b_dec_to_input=False``).
        **settings: ``SparseDictionary`` fields (``architecture``, ``k``, ...); a
            ``"jumprelu"`` one gets thresholds in ``[0, scale)``.
    """
    gen = torch.Generator().manual_seed(seed)
    d_out = d_in if d_out is None else d_out
    tensors: dict[str, Any] = {
        "W_enc": torch.randn(d_in, d_sae, generator=gen) * scale,
        "b_enc": torch.randn(d_sae, generator=gen) * scale / 3,
        "W_dec": torch.randn(d_sae, d_out, generator=gen) * scale,
        "b_dec": torch.randn(d_out, generator=gen) * scale / 3,
    }
    if settings.get("architecture") == "jumprelu":
        tensors["threshold"] = torch.rand(d_sae, generator=gen) * scale
    if skip:
        tensors["W_skip"] = torch.randn(d_out, d_in, generator=gen) * scale / 3
    return SparseDictionary(**tensors, **settings)
