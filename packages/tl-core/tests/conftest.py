"""Shared fixtures: small native bridges of both block styles."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

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


def _write_documents(path: Path, n: int = 40, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "while",
        "dogs",
        "ran",
        "over",
        "hills",
        "and",
        "birds",
        "sang",
        "in",
        "old",
        "trees",
    ]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 30))) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def write_documents() -> Callable[..., Path]:
    """``write_documents(path, n=40, seed=0)``: ``n`` short English-like documents, one per
    line (some empty), written to ``path``."""
    return _write_documents
