"""The capture arena: the driver's own captured values reuse memory nothing holds any more,
and never memory something still holds."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tl_core import TransformerBridge

#: Values the driver computes itself (arena buffers) and one a transformers module computes.
OWN = ("blocks.0.attn.hook_attn_scores", "blocks.1.attn.hook_pattern", "blocks.1.attn.hook_z")
NORMALIZED = ("blocks.0.ln1.hook_normalized", "ln_final.hook_normalized")
NAMES = [*OWN, *NORMALIZED, "blocks.0.mlp.hook_post"]


@pytest.fixture(params=["gpt2", "llama"])
def bridge(request: pytest.FixtureRequest, checkpoint: Callable[[str], Path]) -> TransformerBridge:
    """A fresh bridge (its arena starts empty) of a LayerNorm and an RMSNorm family."""
    return TransformerBridge.boot_transformers(str(checkpoint(request.param)))


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def _ids(seed: int, batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(3, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def _pointers(cache: object, names: tuple[str, ...]) -> dict[str, int]:
    return {n: cache[n].data_ptr() for n in names}  # type: ignore[index]


def test_a_dropped_cache_lends_its_memory_to_the_next_call(bridge: TransformerBridge) -> None:
    _, first = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    before = _pointers(first, OWN + NORMALIZED)
    del first
    _, second = bridge.run_with_cache(_ids(1), names_filter=NAMES)
    assert _pointers(second, OWN + NORMALIZED) == before
    # The values are those of a forward with nothing to reuse.
    reused = {n: second[n].clone() for n in NAMES}
    bridge.driver.capture_arena.clear()
    _, fresh = bridge.run_with_cache(_ids(1), names_filter=NAMES)
    for name in NAMES:
        assert torch.equal(reused[name], fresh[name]), name


def test_memory_something_still_holds_is_never_written(bridge: TransformerBridge) -> None:
    _, held = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    kept = {n: held[n].clone() for n in NAMES}
    # Only a view of one value, and a tensor a hook stashed, outlive their cache.
    _, other = bridge.run_with_cache(_ids(2), names_filter=NAMES)
    view = other["blocks.1.attn.hook_pattern"][0]
    view_before = view.clone()
    stash: list[torch.Tensor] = []

    def keep(x: torch.Tensor, hook: object) -> None:
        stash.append(x)

    with bridge.hooks([("blocks.0.attn.hook_attn_scores", keep)]):
        bridge.forward(_ids(3))
    stashed = stash[0].clone()
    del other
    for seed in (4, 5):
        _, cache = bridge.run_with_cache(_ids(seed), names_filter=NAMES)
        for name in NAMES:
            assert torch.equal(held[name], kept[name]), name
        assert torch.equal(view, view_before)
        assert torch.equal(stash[0], stashed)
        assert cache["blocks.1.attn.hook_pattern"].data_ptr() != view.data_ptr()
        del cache


def test_the_arena_keeps_one_forward_and_frees_on_clear(bridge: TransformerBridge) -> None:
    arena = bridge.driver.capture_arena
    _, cache = bridge.run_with_cache(_ids(0, batch=3), names_filter=NAMES)
    big = arena.nbytes
    own = sum(cache[n].untyped_storage().nbytes() for n in OWN + NORMALIZED)
    assert big == own
    del cache
    _, cache = bridge.run_with_cache(_ids(0, batch=1), names_filter=NAMES)
    assert 0 < arena.nbytes == sum(cache[n].untyped_storage().nbytes() for n in OWN + NORMALIZED)
    assert arena.nbytes < big
    arena.clear()
    assert arena.nbytes == 0


def test_gradients_take_no_part(bridge: TransformerBridge) -> None:
    with torch.enable_grad():
        _, cache = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    assert bridge.driver.capture_arena.nbytes == 0
    _, without = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    assert bridge.driver.capture_arena.nbytes > 0
    for name in NAMES:
        assert torch.equal(cache[name], without[name]), name
