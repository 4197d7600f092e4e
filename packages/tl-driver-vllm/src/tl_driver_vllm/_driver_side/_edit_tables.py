"""Driver side: one prompt's specs on one hook compiled to an edit table for the workers.

A table holds rows of ``x * scale + bias``: one row per prompt position when any spec lists
positions (else one row for every prompt position), then one row for generated tokens,
where only specs without ``pos`` apply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tl_core import InterventionSpec
from tl_core.driver_api import compile_specs
from tl_driver_vllm._wire import pack

__all__ = ["edit_table"]


def edit_table(
    specs: Sequence[InterventionSpec],
    *,
    length: int,
    feature_shape: tuple[int, ...],
    raw: bool = False,
) -> dict[str, Any]:
    """One prompt's specs on one hook as table rows, features flattened.

    Args:
        specs: The prompt's specs on the hook, positions already absolute.
        length: The prompt's length.
        feature_shape: The hook's per-position shape (``(d_model,)``, ``(heads, d_head)``).
        raw: The workers run in this process: hand the tensors over as they are (``pack``).

    Returns:
        ``{"scale", "bias"}`` (float32 ``[rows, prod(feature_shape)]``, packed unless ``raw``;
        head-major for head sites, so a tensor-parallel rank takes its heads as a column
        range) and ``"positional"``.
    """
    width = math.prod(feature_shape)
    positional = any(spec.pos is not None for spec in specs)
    prompt = compile_specs(
        specs, feature_shape=feature_shape, seq_len=length, dtype=torch.float32, device="cpu"
    )
    generated = compile_specs(
        [s for s in specs if s.pos is None], feature_shape=feature_shape, seq_len=1,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    rows = length if positional else 1

    def flat(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.expand(n, *feature_shape).reshape(n, width)

    scale = torch.cat([flat(prompt.scale, rows), flat(generated.scale, 1)])
    bias = torch.cat([flat(prompt.bias, rows), flat(generated.bias, 1)])
    return {"scale": pack(scale, raw=raw), "bias": pack(bias, raw=raw), "positional": positional}
