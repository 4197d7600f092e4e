"""Property tests of the analysis metrics: ragged batches and values that are not finite.

* A metric over a ragged batch (random prompt lengths, right or left padding, garbage in
  the padding) equals the same metric computed by hand on each prompt alone, unpadded.
* ``attribution_patch`` on random ragged pairs reads each prompt at its own positions:
  its metrics equal per-prompt unpadded runs, and each pair scores as it does alone.
* A metric or loss that is NaN or inf anywhere (any pair, scalar or per pair, node or edge
  sweep, ragged or not) always raises a ``UserError`` naming it; nothing is returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tl_core import TransformerBridge, UserError
from tl_core.analysis import attribution_patch, backward_lens, logit_diff, logit_diff_metric

SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
VOCAB = 13
BAD = st.sampled_from([math.nan, math.inf, -math.inf])


@pytest.fixture(scope="module")
def model() -> TransformerBridge:
    bridge = TransformerBridge.boot_native(init_mode="xavier_normal", seed=4)
    bridge.model.to(torch.float64)
    return bridge


@SETTINGS
@given(data=st.data())
def test_logit_diff_on_a_padded_batch_equals_each_prompt_alone(data: st.DataObject) -> None:
    lengths = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4), label="lengths")
    side = data.draw(st.sampled_from(["right", "left"]), label="padding_side")
    width = max(lengths)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    prompts = [torch.randn(n, VOCAB, generator=gen, dtype=torch.float64) for n in lengths]
    # Padding holds values far from any real logit, so reading it cannot go unnoticed.
    padded = torch.full((len(lengths), width, VOCAB), 1e6, dtype=torch.float64)
    for i, own in enumerate(prompts):
        cols = slice(0, len(own)) if side == "right" else slice(width - len(own), width)
        padded[i, cols] = own
    good = data.draw(
        st.lists(st.integers(0, VOCAB - 1), min_size=len(lengths), max_size=len(lengths))
    )
    bad = data.draw(
        st.lists(st.integers(0, VOCAB - 1), min_size=len(lengths), max_size=len(lengths))
    )
    per_prompt = data.draw(st.booleans(), label="positions given")
    positions = (
        [data.draw(st.integers(-n, n - 1), label=f"position {i}") for i, n in enumerate(lengths)]
        if per_prompt
        else None
    )

    got = logit_diff(padded, good, bad, positions, lengths=lengths, padding_side=side)  # type: ignore[arg-type]

    want = []
    for i, own in enumerate(prompts):
        at = len(own) - 1 if positions is None else positions[i] % len(own)
        want.append(float(own[at, good[i]] - own[at, bad[i]]))
    assert got.tolist() == want


@SETTINGS
@given(data=st.data())
def test_positions_a_prompt_does_not_have_are_refused(data: st.DataObject) -> None:
    lengths = data.draw(st.lists(st.integers(1, 6), min_size=2, max_size=4))
    width = max(lengths)
    short = min(range(len(lengths)), key=lambda i: lengths[i])
    position = data.draw(
        st.one_of(
            st.integers(lengths[short], width + 2), st.integers(-width - 2, -lengths[short] - 1)
        )
    )
    logits = torch.zeros(len(lengths), width, VOCAB)
    with pytest.raises(UserError, match=rf"position {position} is out of range for prompt \d"):
        logit_diff(logits, 0, 1, position, lengths=lengths)


def _ragged_pairs(data: st.DataObject) -> tuple[list[list[int]], list[list[int]]]:
    lengths = data.draw(st.lists(st.integers(2, 6), min_size=2, max_size=3), label="lengths")
    token = st.integers(0, 258)
    clean = [data.draw(st.lists(token, min_size=n, max_size=n)) for n in lengths]
    corrupt = []
    for row in clean:
        at = data.draw(st.integers(0, len(row) - 1))
        changed = list(row)
        changed[at] = (changed[at] + 1 + data.draw(st.integers(0, 200))) % 259
        corrupt.append(changed)
    return clean, corrupt


@settings(SETTINGS, max_examples=10)
@given(data=st.data())
def test_attribution_on_ragged_pairs_equals_each_pair_alone(
    model: TransformerBridge, data: st.DataObject
) -> None:
    clean, corrupt = _ragged_pairs(data)
    correct, incorrect = data.draw(st.integers(0, 258)), data.draw(st.integers(0, 258))
    metric = logit_diff_metric(correct, incorrect)
    together = attribution_patch(model, clean, corrupt, metric, granularity="both")
    assert together.metric_clean is not None and together.metric_corrupt is not None
    for i, (good, bad) in enumerate(zip(clean, corrupt, strict=True)):
        with torch.no_grad():
            for run, row in ((together.metric_clean, good), (together.metric_corrupt, bad)):
                last = model([row])[0, -1]
                torch.testing.assert_close(
                    run[i], last[correct] - last[incorrect], rtol=1e-9, atol=1e-10
                )
        alone = attribution_patch(model, [good], [bad], metric, granularity="both")
        for site, scores in alone.nodes.items():
            n = scores.shape[0]
            torch.testing.assert_close(
                together.nodes_per_pair[site][i, :n], scores, rtol=1e-7, atol=1e-9
            )
            assert not together.nodes_per_pair[site][i, n:].any()
        assert alone.edges is not None and together.edges_per_pair is not None
        torch.testing.assert_close(together.edges_per_pair[i], alone.edges, rtol=1e-7, atol=1e-9)


def _poisoned(bad: float, at: int, scalar: bool) -> Callable[..., torch.Tensor]:
    inner = logit_diff_metric(7, 11)

    def poisoned_metric(logits: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        value = inner(logits, lengths)
        value = torch.where(torch.arange(len(lengths)) == at, torch.full_like(value, bad), value)
        return value.sum() if scalar else value

    return poisoned_metric


@SETTINGS
@given(data=st.data())
def test_a_metric_that_is_not_finite_anywhere_always_raises(
    model: TransformerBridge, data: st.DataObject
) -> None:
    clean, corrupt = _ragged_pairs(data)
    if data.draw(st.booleans(), label="equal lengths"):
        width = min(len(r) for r in clean)
        clean, corrupt = [r[:width] for r in clean], [r[:width] for r in corrupt]
    bad = data.draw(BAD, label="bad")
    at = data.draw(st.integers(0, len(clean) - 1), label="pair")
    metric = _poisoned(bad, at, data.draw(st.booleans(), label="scalar"))
    granularity = data.draw(st.sampled_from(["node", "edge", "both"]))
    with pytest.raises(UserError, match=r"metric 'poisoned_metric' returned .* not finite"):
        attribution_patch(model, clean, corrupt, metric, granularity=granularity)  # type: ignore[arg-type]
    assert all(not p.has_hooks for p in model.hook_dict.values())


@SETTINGS
@given(data=st.data())
def test_a_loss_that_is_not_finite_anywhere_always_raises(
    model: TransformerBridge, data: st.DataObject
) -> None:
    clean, _ = _ragged_pairs(data)
    bad = data.draw(BAD, label="bad")
    row = data.draw(st.integers(0, len(clean) - 1), label="prompt")

    def poisoned_loss(logits: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        last = torch.tensor(lengths) - 1
        picked = logits[torch.arange(len(lengths)), last, 3]
        return torch.where(
            torch.arange(len(lengths)) == row, torch.full_like(picked, bad), picked
        ).sum()

    with pytest.raises(UserError, match=r"loss 'poisoned_loss' is -?(nan|inf), not a finite"):
        backward_lens(model, clean, loss=poisoned_loss)
