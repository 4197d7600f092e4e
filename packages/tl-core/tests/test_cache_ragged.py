"""``pos_slice`` on a cache of prompts of different lengths reads each prompt's own positions.

The batch is right-padded, so column ``-1`` of a shorter prompt is padding. The reference
for every check is the same analysis on each prompt cached alone, without padding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tl_core import TransformerBridge, UserError

PROMPTS = [[1, 5, 9, 14, 20, 33], [1, 7, 30]]


@pytest.fixture(scope="module")
def model() -> TransformerBridge:
    bridge = TransformerBridge.boot_native(init_mode="xavier_normal", seed=6)
    bridge.model.to(torch.float64)
    return bridge


def _alone(model: TransformerBridge, call: Any) -> list[torch.Tensor]:
    """``call(cache)`` on each prompt cached alone, batch axis dropped."""
    out = []
    for row in PROMPTS:
        _, cache = model.run_with_cache([row])
        out.append(call(cache).select(1, 0))  # [component, batch=1, ...] -> [component, ...]
    return out


@pytest.mark.parametrize(
    "call",
    [
        lambda c, p: c.accumulated_resid(pos_slice=p, apply_ln=True),
        lambda c, p: c.decompose_resid(pos_slice=p, apply_ln=True),
        lambda c, p: c.logit_attrs(c.decompose_resid(pos_slice=p), 7, 11, pos_slice=p),
    ],
    ids=["accumulated_resid", "decompose_resid", "logit_attrs"],
)
@pytest.mark.parametrize("pos_slice", [-1, [-2, -1], [0, 2], slice(-3, None)], ids=str)
def test_a_ragged_cache_is_read_at_each_prompts_own_positions(
    model: TransformerBridge, call: Any, pos_slice: Any
) -> None:
    _, cache = model.run_with_cache(PROMPTS)
    assert cache.lengths == (6, 3)
    together = call(cache, pos_slice)
    for i, want in enumerate(_alone(model, lambda c: call(c, pos_slice))):
        torch.testing.assert_close(together.select(1, i), want, rtol=1e-9, atol=1e-10)


def test_positions_a_prompt_lacks_are_refused_naming_it(model: TransformerBridge) -> None:
    _, cache = model.run_with_cache(PROMPTS)
    with pytest.raises(UserError, match="index 4 is out of range for prompt 1, which has 3"):
        cache.accumulated_resid(pos_slice=4)
    with pytest.raises(UserError, match=r"index -4 is out of range for prompt 1"):
        cache.decompose_resid(pos_slice=[-4, -1])
    with pytest.raises(UserError, match=r"selects \[4, 1\] positions from prompts of lengths"):
        cache.accumulated_resid(pos_slice=slice(2, None))
    # Every column, padding included, as before.
    assert cache.accumulated_resid(pos_slice=None).shape[2] == 6
    assert cache.accumulated_resid(pos_slice=slice(None)).shape[2] == 6
