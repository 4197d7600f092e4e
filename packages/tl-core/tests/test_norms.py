"""tl-core's one copy of the norm math, against torch's own norms, and the epsilon of a norm
module read or measured."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from tl_core.architecture import NORM_KINDS
from tl_core.driver_api import (
    apply_norm_weight,
    centred_input,
    norm_module_eps,
    norm_statistics,
)


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(2, 24),
    eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
    spread=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_layernorm_and_rms_statistics_match_torch(
    width: int, eps: float, spread: float, seed: int
) -> None:
    x = (
        torch.randn(2, 3, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        * spread
    )
    weight = torch.randn(width, dtype=torch.float64)
    bias = torch.randn(width, dtype=torch.float64)
    scale, normalized = norm_statistics(x, "layernorm", eps)
    want = nn.functional.layer_norm(x, (width,), weight, bias, eps=eps)
    torch.testing.assert_close(
        apply_norm_weight(normalized, weight, bias, "layernorm", x.dtype), want
    )
    torch.testing.assert_close(normalized * scale, centred_input(x, "layernorm"))
    torch.testing.assert_close(scale, (x.var(-1, correction=0, keepdim=True) + eps).sqrt())
    # RMS norms compute in float32 (as transformers' do): float32 tolerances.
    f32 = {"rtol": 1e-5, "atol": 1e-5 * max(1.0, float(weight.abs().max()))}
    rms_scale, rms_normalized = norm_statistics(x, "rms", eps)
    torch.testing.assert_close(rms_normalized * rms_scale, centred_input(x, "rms"))
    want_scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    torch.testing.assert_close(rms_scale.double(), want_scale, rtol=1e-5, atol=0.0)
    want_rms = nn.functional.rms_norm(x, (width,), weight, eps=eps)
    torch.testing.assert_close(
        apply_norm_weight(rms_normalized, weight, None, "rms", x.dtype), want_rms, **f32
    )
    plus_one = apply_norm_weight(rms_normalized, weight, None, "rms_plus_one", x.dtype)
    torch.testing.assert_close(
        plus_one, nn.functional.rms_norm(x, (width,), 1.0 + weight, eps=eps), **f32
    )


class _CodedEpsNorm(nn.Module):
    """A weightless norm whose epsilon lives in its forward, as OLMo's LayerNorm's does."""

    def __init__(self, eps: float, rms: bool) -> None:
        super().__init__()
        self._coded, self._rms = eps, rms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._coded)
        return nn.functional.layer_norm(x, x.shape[-1:], eps=self._coded)


def test_an_epsilon_attribute_is_read_whatever_the_family_calls_it() -> None:
    assert norm_module_eps(nn.LayerNorm(8, eps=1e-7)) == 1e-7
    assert norm_module_eps(nn.RMSNorm(8, eps=3e-6)) == 3e-6
    module = nn.Module()
    module.variance_epsilon = 1e-6
    assert norm_module_eps(module) == 1e-6


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-8, 1e-3])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rms"])
def test_an_epsilon_written_in_code_is_measured_exactly(eps: float, rms: bool) -> None:
    module = _CodedEpsNorm(eps, rms)
    with pytest.raises(AttributeError, match="has no variance_epsilon/eps/epsilon attribute"):
        norm_module_eps(module)  # nothing to measure with: no kind and width
    assert norm_module_eps(module, "rms" if rms else "layernorm", 16) == eps
    assert norm_module_eps(module) == eps  # remembered for the module
    with pytest.raises(AttributeError, match="no common epsilon reproduces its output"):
        norm_module_eps(_CodedEpsNorm(eps, rms), "layernorm" if rms else "rms", 16)


def test_an_epsilon_no_candidate_reproduces_is_refused() -> None:
    for kind in NORM_KINDS:
        with pytest.raises(AttributeError, match=f"as a {kind!r} norm"):
            norm_module_eps(_CodedEpsNorm(2.5e-4, rms=False), kind, 16)


class _ShapedCodedNorm(nn.Module):
    """OLMo's LayerNorm: no weight, a fixed width, its epsilon written in its forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.normalized_shape = (width,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.float(), self.normalized_shape, None, None, eps=1e-5).to(
            x.dtype
        )


def test_a_weightless_norm_is_measured_at_its_own_width() -> None:
    # The width passed is only a fallback: this norm refuses any width but its own.
    assert norm_module_eps(_ShapedCodedNorm(12), "layernorm", width=64) == 1e-5


@pytest.mark.parametrize("kind", NORM_KINDS)
def test_statistics_with_gradients_equal_those_without_and_carry_the_gradient(kind: str) -> None:
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)) * 4 + 1
    plain_scale, plain_normalized = norm_statistics(x, kind, 1e-5)  # type: ignore[arg-type]
    leaf = x.clone().requires_grad_(True)
    scale, normalized = norm_statistics(leaf, kind, 1e-5)  # type: ignore[arg-type]
    torch.testing.assert_close(scale, plain_scale)
    torch.testing.assert_close(normalized, plain_normalized)
    # The scale's gradient reaches the input: hook_scale's backward hooks depend on it.
    (grad,) = torch.autograd.grad(scale.sum(), leaf)
    want = (centred_input(x, kind) / plain_scale / x.shape[-1]).to(grad.dtype)  # type: ignore[arg-type]
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("kind", ["layernorm", "rms"])
def test_statistics_written_into_a_buffer_are_the_same_bits(kind: str) -> None:
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    scale, normalized = norm_statistics(x, kind, 1e-5)  # type: ignore[arg-type]
    out = torch.empty_like(normalized)
    got_scale, got = norm_statistics(x, kind, 1e-5, out=out)  # type: ignore[arg-type]
    assert got is out
    assert torch.equal(got, normalized) and torch.equal(got_scale, scale)
    # Where autograd records, the buffer (which it could not track) is left alone.
    unused = torch.full_like(normalized, 7.0)
    _, tracked = norm_statistics(x.clone().requires_grad_(), kind, 1e-5, out=unused)  # type: ignore[arg-type]
    assert tracked.requires_grad and bool((unused == 7.0).all())


def test_layernorm_statistics_under_inference_mode_leave_gradients_working() -> None:
    """A vLLM worker computes statistics under inference mode; an hf forward with gradients
    in the same process must still get a gradient through them."""
    with torch.inference_mode():
        norm_statistics(torch.randn(2, 8), "layernorm", 1e-5)
    x = torch.randn(2, 8, requires_grad=True)
    scale, normalized = norm_statistics(x, "layernorm", 1e-5)
    (normalized.sum() + scale.sum()).backward()  # type: ignore[no-untyped-call]
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
