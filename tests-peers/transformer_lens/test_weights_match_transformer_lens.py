"""Every weight accessor reads back what TransformerLens 4.3's reads, plain and processed.

After ``enable_compatibility_mode()`` the accessors (``W_E``, ``W_U``, ``W_in``, ``W_out``,
their biases and the attention weights) must hold HookedTransformer's processed weights:
folded norms, centred writers, a vocabulary-centred unembedding, folded value biases. Each
family's tiny checkpoint is processed by both tools and every accessor compared.

Where a checkpoint has no such bias, TransformerLens raises ``AttributeError`` and tl reads
zeros; the test checks that tl's zeros are zeros. ``WEIGHT_SLIPS`` lists where
TransformerLens 4.3's processed weight is not HookedTransformer's, with the evidence of
what it is instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformer_lens")

import _transformer_lens_peer as _shared  # noqa: E402  (conftest puts this folder on sys.path)

from tl_core import TransformerBridge, UnsupportedFeatureError  # noqa: E402

#: fp32 weights; tl folds in float64, TransformerLens in float32.
ATOL = 1e-5
ACCESSORS = (
    "W_E",
    "W_pos",
    "W_U",
    "b_U",
    "W_Q",
    "W_K",
    "W_V",
    "W_O",
    "b_Q",
    "b_K",
    "b_V",
    "b_O",
    "W_in",
    "W_gate",
    "W_out",
    "b_in",
    "b_out",
)


@dataclass(frozen=True)
class Bridges:
    """tl's bridge of this run and tl's bridge without compatibility mode."""

    ours: TransformerBridge
    plain: TransformerBridge


@dataclass(frozen=True)
class WeightSlip:
    """Where TransformerLens 4.3's accessor holds another weight than HookedTransformer's.

    ``evidence(theirs, bridges)`` returns two tensors that must be equal, relating
    TransformerLens's value to tl's.
    """

    families: tuple[str, ...]
    accessor: str
    evidence: Callable[[Any, Bridges], tuple[Any, Any]]
    reason: str
    compat_only: bool = False


def _unscaled_embedding(theirs: Any, bridges: Bridges) -> tuple[Any, Any]:
    scale = math.sqrt(bridges.ours.cfg.d_model)
    return theirs * torch.tensor(scale, dtype=theirs.dtype), bridges.ours.W_E


def _final_norm_weight(bridge: TransformerBridge) -> Any:
    return bridge.driver.hf_model.model.norm.weight.detach()  # type: ignore[attr-defined]


def _uncentred_gate(theirs: Any, bridges: Bridges) -> tuple[Any, Any]:
    return theirs - theirs.mean(-2, keepdim=True), bridges.ours.W_gate


def _unfolded_final_norm(theirs: Any, bridges: Bridges) -> tuple[Any, Any]:
    return theirs * _final_norm_weight(bridges.plain)[:, None], bridges.ours.W_U


WEIGHT_SLIPS = [
    WeightSlip(
        ("gemma", "gemma2", "gemma3"),
        "W_E",
        _unscaled_embedding,
        "TransformerLens 4.3's W_E on Gemma is the embedding module's raw table; the "
        "module multiplies its lookups by sqrt(d_model), so hook_embed != W_E[tokens] there. "
        "tl's W_E includes the scale (HookedTransformer's convention)",
    ),
    WeightSlip(
        ("stablelm",),
        "W_gate",
        _uncentred_gate,
        "TransformerLens 4.3 folds the pre-MLP LayerNorm into W_gate without centring it "
        "over d_model, while it centres W_in beside it; tl centres every weight reading a "
        "LayerNorm (the same activations: the norm's output has zero mean)",
        compat_only=True,
    ),
    WeightSlip(
        ("olmo2",),
        "W_U",
        _unfolded_final_norm,
        "TransformerLens 4.3 folds no norm of OLMo 2, not even the final one; tl folds the "
        "final norm's weight into W_U",
        compat_only=True,
    ),
]


def _slip(family: str, accessor: str, compat: bool) -> WeightSlip | None:
    for slip in WEIGHT_SLIPS:
        if (
            family in slip.families
            and slip.accessor == accessor
            and (compat or not slip.compat_only)
        ):
            return slip
    return None


def _read_theirs(bridge: Any, name: str) -> Any:
    try:
        return getattr(bridge, name)
    except AttributeError:  # TransformerLens: the checkpoint has no such weight
        return None


def _read_ours(bridge: TransformerBridge, name: str) -> Any:
    try:
        return getattr(bridge, name)
    except UnsupportedFeatureError:  # tl: no such weight in this family
        return None


@pytest.mark.parametrize("checkpoint", _shared.MASKED)
def test_every_weight_of_a_masked_lm_reads_back_as_transformer_lens_reads_it(
    checkpoint: str, checkpoints: Callable[[str], Path]
) -> None:
    """BERT and RoBERTa as loaded (neither tool folds a post-LN model's norms)."""
    test_every_weight_reads_back_as_transformer_lens_reads_it(checkpoint, False, checkpoints)


@pytest.mark.parametrize("compat", _shared.MODES.values(), ids=_shared.MODES.keys())
@pytest.mark.parametrize("checkpoint", _shared.CHECKPOINTS)
def test_every_weight_reads_back_as_transformer_lens_reads_it(
    checkpoint: str, compat: bool, checkpoints: Callable[[str], Path]
) -> None:
    folder = checkpoints(checkpoint)
    family = _shared.family_of(checkpoint)
    theirs = _shared.boot_theirs(folder, compat)
    bridges = Bridges(_shared.boot_ours(folder, compat), _shared.boot_ours(folder, False))
    failures: list[str] = []
    compared: set[str] = set()
    slips = 0
    for name in ACCESSORS:
        want, got = _read_theirs(theirs, name), _read_ours(bridges.ours, name)
        if want is None and got is None:
            continue
        if want is None:
            # A bias the checkpoint lacks: TransformerLens raises, tl reads zeros.
            if name.startswith("b_") and not bool(got.any()):
                continue
            failures.append(f"{name}: TransformerLens has none, tl reads {tuple(got.shape)}")
            continue
        if got is None:
            failures.append(f"{name}: tl has none, TransformerLens reads {tuple(want.shape)}")
            continue
        slip = _slip(family, name, compat)
        if slip is not None:
            want, got = slip.evidence(want, bridges)
            slips += 1
        diff = _shared.relative_difference(got, want)
        if diff > ATOL:
            what = (
                "TL slip, evidence off"
                if slip
                else f"tl {tuple(got.shape)} vs TL {tuple(want.shape)}"
            )
            failures.append(f"{name}: {what} by {diff:.3g}")
        compared.add(name)
    assert not failures, f"{checkpoint}: {len(failures)} accessors differ:\n" + "\n".join(failures)
    # Every family has these, so both tools must have read them.
    assert {"W_E", "W_U", "W_Q", "W_K", "W_V", "W_O"} <= compared, sorted(compared)
    mode = " (compatibility mode)" if compat else ""
    print(
        f"{checkpoint}{mode}: {len(compared) - slips} of {len(compared)} weights equal, "
        f"{slips} TransformerLens slips confirmed"
    )
