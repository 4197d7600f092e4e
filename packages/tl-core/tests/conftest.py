"""Shared fixtures: small native bridges of both block styles."""

from __future__ import annotations

import pytest
import torch

from tl_core import TransformerBridge

STYLES = ("gpt2", "llama")


@pytest.fixture(scope="module", params=STYLES)
def bridge(request: pytest.FixtureRequest) -> TransformerBridge:
    """A 3-layer native model of each block style (attn results enabled)."""
    return TransformerBridge.boot_native(request.param, n_layers=3, use_attn_result=True, seed=1)


@pytest.fixture(autouse=True)
def _fp32_determinism() -> None:
    torch.manual_seed(0)
