"""check_rounding: a float32 result judged by its error against float64, relative to a peer's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tl_core.certification import DEFAULT_ERROR_FACTOR, check_rounding


def _exact_and_rounded(
    seed: int, shape: tuple[int, ...] = (3, 7, 16)
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 product and the same product computed in float32."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape[:-1], 64, generator=gen, dtype=torch.float64)
    b = torch.randn(64, shape[-1], generator=gen, dtype=torch.float64) * 30
    return a @ b, (a.float() @ b.float())


def test_another_summation_order_passes() -> None:
    exact, peer = _exact_and_rounded(0)
    # The same product summed in reverse order, in float32.
    gen = torch.Generator().manual_seed(0)
    left = torch.randn(3, 7, 64, generator=gen, dtype=torch.float64).float()
    right = (torch.randn(64, 16, generator=gen, dtype=torch.float64) * 30).float()
    reversed_order = (left.flip(-1).unsqueeze(-1) * right.flip(0)).sum(-2)
    check = check_rounding(reversed_order, peer, exact, name="matmul")
    assert check.ok, str(check)
    assert check.factor == DEFAULT_ERROR_FACTOR


@given(seed=st.integers(0, 2**16), relative=st.floats(1e-4, 1e-1))
@settings(max_examples=40, deadline=None)
def test_a_real_change_fails(seed: int, relative: float) -> None:
    """A perturbation of 1e-4 of the values or more is hundreds of float32 errors: it fails."""
    exact, peer = _exact_and_rounded(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    defect = peer + relative * exact.abs().max().float() * torch.randn(peer.shape, generator=gen)
    check = check_rounding(defect, peer, exact)
    assert not check.ok and check.ratio > 1, str(check)
    assert "TOO FAR" in str(check)


def test_the_factor_is_a_multiple_of_the_peers_error() -> None:
    exact = torch.zeros(1000, dtype=torch.float64)
    peer = torch.full((1000,), 1e-3)
    triple = torch.full((1000,), 3e-3)
    assert check_rounding(triple, peer, exact, factor=4).ok
    assert not check_rounding(triple, peer, exact, factor=2).ok
    assert check_rounding(triple, peer, exact, factor=4).ratio == pytest.approx(0.75)


def test_an_exact_peer_does_not_demand_exactness() -> None:
    """A few rounding steps of the values' size are always allowed, even when the peer is exact."""
    exact = torch.linspace(1, 1000, 50, dtype=torch.float64) / 3
    peer = exact.clone()
    one_step = exact * (1 + torch.finfo(torch.float32).eps / 2)  # what rounding to float32 may do
    assert check_rounding(one_step, peer, exact).ok
    assert not check_rounding(exact + 1e-2, peer, exact).ok


def test_all_zero_tensors_pass() -> None:
    """A suppressed site is zero everywhere: nothing to divide by, nothing wrong."""
    zero = torch.zeros(4, 8)
    check = check_rounding(zero, zero, zero.double())
    assert check.ok and check.ratio == 0.0
    assert check_rounding(zero + 1e-30, zero, zero.double()).ratio == float("inf")


def test_masked_entries_equal_on_both_sides_count_zero() -> None:
    exact = torch.tensor([[0.5, float("-inf")], [0.25, 1.0]], dtype=torch.float64)
    peer = exact.float()
    assert check_rounding(peer.clone(), peer, exact).ok


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_on_one_side_fails(bad: float) -> None:
    exact = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    candidate = exact.float().clone()
    candidate[1] = bad
    check = check_rounding(candidate, exact.float(), exact)
    assert not check.ok and check.candidate_max == float("inf")


def test_bad_arguments_are_refused() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"hook_x: shapes differ: candidate \(2, 3\), peer \(3, 2\)"
    ):
        check_rounding(x, x.T, x.double(), name="hook_x")
    with pytest.raises(ValueError, match="factor must be positive"):
        check_rounding(x, x, x.double(), factor=0)
