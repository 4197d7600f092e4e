"""Test support: engine settings and structured comparisons (one failure lists every hook)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: Small engine settings: a 32-token step makes longer prompts span steps (chunked prefill).
ENGINE_OPTIONS: dict[str, Any] = {
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 32 * 2**20,
}


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference (inf on a shape mismatch)."""
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def check(report: Mapping[str, float], tol: float, what: str) -> None:
    """Fail naming every entry over ``tol``, with its difference."""
    bad = {k: v for k, v in report.items() if not v <= tol}
    assert not bad, f"{what}: {len(bad)} of {len(report)} over {tol:g}: " + ", ".join(
        f"{k}={v:.3g}" for k, v in sorted(bad.items())
    )
