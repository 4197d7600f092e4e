"""Tolerance bands per dtype and engine pair (the table in the README)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Band", "band_for", "engine_of"]


@dataclass(frozen=True)
class Band:
    """``|cand - ref| <= atol + rtol * |ref|`` elementwise, with ``atol`` scaled by the
    hook's largest reference magnitude ``M``: ``atol = max(atol_floor, atol_scale * M)``.

    Attributes:
        atol_floor: Smallest absolute tolerance.
        atol_scale: Fraction of ``max|ref|`` used when that is larger than the floor.
        rtol: Relative tolerance.
    """

    atol_floor: float
    atol_scale: float
    rtol: float

    def atol(self, ref_max_abs: float) -> float:
        """The absolute tolerance for a hook whose reference peaks at ``ref_max_abs``."""
        return max(self.atol_floor, self.atol_scale * ref_max_abs)


#: Same engine on both sides (the same kernels run twice): only run-to-run noise.
SAME_ENGINE: Mapping[str, Band] = {
    "float32": Band(1e-5, 0.0, 1e-5),
    "float16": Band(1e-3, 0.0, 1e-3),
    "bfloat16": Band(1e-2, 0.0, 1e-2),
}
#: Different engines (other kernels, fused ops, other reduction orders). fp32 is DESIGN.md's
#: serving band; the half-precision bands are wider by the dtypes' epsilon ratio.
CROSS_ENGINE: Mapping[str, Band] = {
    "float32": Band(2e-2, 2e-3, 2e-2),
    "float16": Band(5e-2, 1e-2, 5e-2),
    "bfloat16": Band(1e-1, 2e-2, 1e-1),
}

_VLLM_PROVIDERS = ("tl_bridge_vllm", "tl_vllm")


def engine_of(driver: str, options: Mapping[str, Any] | None = None) -> str:
    """The engine that computes a driver's numbers: ``inspect`` runs hf unless its provider is vLLM."""
    if driver == "inspect":
        provider = (options or {}).get("provider", "tl_bridge")
        return "vllm" if provider in _VLLM_PROVIDERS else "hf"
    return driver


def band_for(
    dtype: str,
    reference: str,
    candidate: str,
    reference_options: Mapping[str, Any] | None = None,
    candidate_options: Mapping[str, Any] | None = None,
) -> Band:
    """The band for comparing ``candidate`` against ``reference`` in ``dtype``.

    Raises:
        ValueError: An unknown dtype.
    """
    table = (
        SAME_ENGINE
        if engine_of(reference, reference_options) == engine_of(candidate, candidate_options)
        else CROSS_ENGINE
    )
    if dtype not in table:
        raise ValueError(f"no tolerance band for dtype {dtype!r}; use one of {', '.join(table)}")
    return table[dtype]
