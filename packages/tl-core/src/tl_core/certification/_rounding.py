"""Is a float32 result as close to the exact one as another float32 implementation's?

Two correct float32 implementations of the same network differ by rounding, and how much
depends on the processor: a matrix multiply sums in the order its kernel picks for the
shape, the data's alignment and the instruction set, so a band written as "within N
rounding steps of the other implementation" holds on one machine and fails on the next.
What holds everywhere is a statement about errors: run the same weights in float64 (the
*exact* result, whose own error is ~1e-9 of float32's), measure how far a trusted float32
implementation (the *peer*: plain transformers, the hf driver) lands from it, and require
the candidate to land no further than a small multiple of that. A candidate that sums in
another order passes on every processor; one that computes something else (a layer off by
one, a norm without its weight, an attention scale off by 1%) misses by orders of
magnitude, since float32 keeps ~7 digits and such defects change the 2nd or 3rd.

The exact run is as exact as its code: transformers computes RMS norms in float32 even in
a float64 model (as the hf driver does, to match it), so a float64 run of those families
carries one float32 rounding per norm; that is still several times below the error a
float32 run accumulates over its matrix multiplies, and the same in every run compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_ERROR_FACTOR", "RoundingCheck", "check_rounding"]

#: How many times the peer's own float32 error a candidate may show when both run the same
#: kernels on other data layouts: the hf driver measured 0.9-2.1x transformers' error on
#: SmolLM2. A block off by one measures 1,500x or more, a norm without its weight 10^4x, an
#: attention scale off by 1% 30x. Another engine's kernels need a larger factor (the vLLM
#: tests measure theirs).
DEFAULT_ERROR_FACTOR = 4.0
#: Rounding steps of the exact values' size always allowed: the exact run rounds to float32
#: wherever its code computes in float32 (transformers' RMS norms, so every hook_scale), and
#: a peer that shares that rounding looks exact there.
FLOOR_STEPS = 4.0
_EPS32 = torch.finfo(torch.float32).eps


def _errors(x: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """``(max, rms)`` of ``|x - exact|``; equal entries (masked ``-inf`` scores too) count 0,
    a NaN or an infinity on one side only makes both ``inf``."""
    if exact.numel() == 0:
        return 0.0, 0.0
    x64 = x.detach().to(torch.float64)
    diff = (x64 - exact).masked_fill(x64 == exact, 0.0).abs()
    if not bool(diff.isfinite().all()):
        return float("inf"), float("inf")
    return float(diff.max()), float(diff.pow(2).mean().sqrt())


def _share(error: float, limit: float) -> float:
    """``error / limit``; an exact zero within a zero limit (all-zero tensors) is 0."""
    if limit > 0:
        return error / limit
    return 0.0 if error == 0 else float("inf")


@dataclass(frozen=True)
class RoundingCheck:
    """One comparison of a candidate's and a peer's float32 errors against an exact result.

    Errors are measured two ways, the largest elementwise error (``*_max``) and the
    root-mean-square error (``*_rms``); the candidate passes when each is within
    ``factor`` times the peer's, plus a floor of ``FLOOR_STEPS`` float32 rounding steps of
    the exact values' size (so a peer that happens to be exact does not demand exactness).

    Attributes:
        name: What was compared (a hook name, ``"logits"``), for messages.
        candidate_max: ``max|candidate - exact|``.
        candidate_rms: ``rms(candidate - exact)``.
        peer_max: ``max|peer - exact|``.
        peer_rms: ``rms(peer - exact)``.
        exact_max: ``max|exact|``.
        exact_rms: ``rms(exact)``.
        factor: The allowed multiple of the peer's error.
    """

    name: str
    candidate_max: float
    candidate_rms: float
    peer_max: float
    peer_rms: float
    exact_max: float
    exact_rms: float
    factor: float

    @property
    def limit_max(self) -> float:
        """The largest ``candidate_max`` that passes."""
        return self.factor * self.peer_max + FLOOR_STEPS * _EPS32 * self.exact_max

    @property
    def limit_rms(self) -> float:
        """The largest ``candidate_rms`` that passes."""
        return self.factor * self.peer_rms + FLOOR_STEPS * _EPS32 * self.exact_rms

    @property
    def ok(self) -> bool:
        """Whether the candidate is within the allowed multiple of the peer's error."""
        return self.candidate_max <= self.limit_max and self.candidate_rms <= self.limit_rms

    @property
    def ratio(self) -> float:
        """The candidate's error as a multiple of what is allowed (<= 1 passes)."""
        return max(
            _share(self.candidate_max, self.limit_max), _share(self.candidate_rms, self.limit_rms)
        )

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "TOO FAR"
        return (
            f"{self.name}: {verdict}, error max {self.candidate_max:.3g} (peer {self.peer_max:.3g}), "
            f"rms {self.candidate_rms:.3g} (peer {self.peer_rms:.3g}), "
            f"{self.ratio:.3g}x the allowed {self.factor:g}x peer + {FLOOR_STEPS:g} rounding steps"
        )


def check_rounding(
    candidate: torch.Tensor,
    peer: torch.Tensor,
    exact: torch.Tensor,
    *,
    name: str = "",
    factor: float = DEFAULT_ERROR_FACTOR,
) -> RoundingCheck:
    """Compare a float32 candidate's error with a float32 peer's, both against an exact run.

    Args:
        candidate: The result under test (any float dtype; compared in float64).
        peer: A trusted implementation's result for the same inputs in the same dtype.
        exact: The same computation in float64 (the peer run in float64 usually).
        name: A label for messages.
        factor: The allowed multiple of the peer's error (see ``DEFAULT_ERROR_FACTOR``).

    Returns:
        The ``RoundingCheck``; ``.ok`` tells whether the candidate passes, ``str()`` says by
        how much.

    Raises:
        ValueError: The three tensors do not have one shape, or ``factor`` is not positive.
    """
    if not (candidate.shape == peer.shape == exact.shape):
        raise ValueError(
            f"{name or 'check_rounding'}: shapes differ: candidate {tuple(candidate.shape)}, "
            f"peer {tuple(peer.shape)}, exact {tuple(exact.shape)}"
        )
    if not factor > 0:
        raise ValueError(f"factor must be positive, got {factor}")
    exact64 = exact.detach().to(torch.float64)
    cand_max, cand_rms = _errors(candidate, exact64)
    peer_max, peer_rms = _errors(peer, exact64)
    finite = exact64.masked_fill(~exact64.isfinite(), 0.0)
    exact_max, exact_rms = _errors(finite, torch.zeros_like(finite))
    return RoundingCheck(name, cand_max, cand_rms, peer_max, peer_rms, exact_max, exact_rms, factor)
