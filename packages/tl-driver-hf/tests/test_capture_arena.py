"""The capture arena: the driver's own captured values reuse memory nothing holds any more,
and never memory something still holds."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from tl_core import TransformerBridge
from tl_driver_hf._runtime._arena import CaptureArena, head_into_arena

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


def _arena_names(bridge: TransformerBridge) -> tuple[str, ...]:
    """The values written into the arena: an RMS norm's normalized value too (a LayerNorm's
    comes from the fused kernel's own output)."""
    rms = bridge.driver.adapter.description.norm != "layernorm"  # type: ignore[attr-defined]
    return OWN + NORMALIZED if rms else OWN


def _pointers(cache: object, names: tuple[str, ...]) -> dict[str, int]:
    return {n: cache[n].data_ptr() for n in names}  # type: ignore[index]


def test_a_dropped_cache_lends_its_memory_to_the_next_call(bridge: TransformerBridge) -> None:
    logits, first = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    before = _pointers(first, _arena_names(bridge))
    before_logits = logits.data_ptr()
    del first, logits
    logits, second = bridge.run_with_cache(_ids(1), names_filter=NAMES)
    assert _pointers(second, _arena_names(bridge)) == before
    assert logits.data_ptr() == before_logits
    # The values are those of a forward with nothing to reuse, and of one the arena takes
    # no part in (with gradients, the head is transformers' own nn.Linear).
    reused = {n: second[n].clone() for n in NAMES}
    reused_logits = logits.clone()
    bridge.driver.capture_arena.clear()
    fresh_logits, fresh = bridge.run_with_cache(_ids(1), names_filter=NAMES)
    with torch.enable_grad():
        tracked_logits, tracked = bridge.run_with_cache(_ids(1), names_filter=NAMES)
    for name in NAMES:
        assert torch.equal(reused[name], fresh[name]), name
        assert torch.equal(reused[name], tracked[name]), name
    assert torch.equal(reused_logits, fresh_logits)
    assert torch.equal(reused_logits, tracked_logits.detach())


def test_memory_something_still_holds_is_never_written(bridge: TransformerBridge) -> None:
    held_logits, held = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    kept = {n: held[n].clone() for n in NAMES}
    kept_logits = held_logits.clone()
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
        assert torch.equal(held_logits, kept_logits)
        assert torch.equal(view, view_before)
        assert torch.equal(stash[0], stashed)
        assert cache["blocks.1.attn.hook_pattern"].data_ptr() != view.data_ptr()
        del cache


def test_the_arena_keeps_one_forward_and_frees_on_clear(bridge: TransformerBridge) -> None:
    arena = bridge.driver.capture_arena
    logits, cache = bridge.run_with_cache(_ids(0, batch=3), names_filter=NAMES)
    big = arena.nbytes
    own = sum(cache[n].untyped_storage().nbytes() for n in _arena_names(bridge))
    assert big == own + logits.untyped_storage().nbytes()
    del cache, logits
    logits, cache = bridge.run_with_cache(_ids(0, batch=1), names_filter=NAMES)
    own = sum(cache[n].untyped_storage().nbytes() for n in _arena_names(bridge))
    assert 0 < arena.nbytes == own + logits.untyped_storage().nbytes()
    assert arena.nbytes < big
    arena.clear()
    assert arena.nbytes == 0


def test_a_disabled_arena_keeps_nothing(bridge: TransformerBridge) -> None:
    arena = bridge.driver.capture_arena
    _, cache = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    assert arena.nbytes > 0
    on = {n: cache[n].clone() for n in NAMES}
    del cache
    arena.enabled = False
    try:
        _, cache = bridge.run_with_cache(_ids(0), names_filter=NAMES)
        assert arena.nbytes == 0
        for name in NAMES:
            assert torch.equal(cache[name], on[name]), name
    finally:
        arena.enabled = True


def test_past_its_budget_a_forward_takes_fresh_memory(bridge: TransformerBridge) -> None:
    arena = bridge.driver.capture_arena
    logits, cache = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    everything = arena.nbytes
    logits_bytes = logits.untyped_storage().nbytes()
    del logits, cache
    arena.max_bytes = everything - logits_bytes  # the logits come last and no longer fit
    try:
        bridge.run_with_cache(_ids(0), names_filter=NAMES)
        assert arena.nbytes == everything - logits_bytes
        arena.max_bytes = 0
        bridge.run_with_cache(_ids(0), names_filter=NAMES)
        assert arena.nbytes == 0
    finally:
        arena.max_bytes = arena.DEFAULT_MAX_BYTES


def test_inference_mode_and_no_grad_calls_mix(bridge: TransformerBridge) -> None:
    """Buffers made under inference mode cannot be written outside it (and its tensors keep
    no version counter, which the norm hooks read to see in-place edits)."""
    _, reference = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    want = {n: reference[n].clone() for n in NAMES}
    del reference
    for inference in (True, False, True):
        with torch.inference_mode(inference):
            _, cache = bridge.run_with_cache(_ids(0), names_filter=NAMES)
        for name in NAMES:
            assert torch.equal(cache[name], want[name]), (inference, name)
        del cache


def test_an_in_place_edit_of_a_normalized_value_under_inference_mode_reaches_the_model(
    bridge: TransformerBridge,
) -> None:
    def zero_last(x: torch.Tensor, hook: object) -> None:
        x[:, -1] = 0.0

    site = "ln_final.hook_normalized"
    with torch.inference_mode():
        plain = bridge.forward(_ids(0))
        with bridge.hooks([(site, zero_last)]):
            edited = bridge.forward(_ids(0))
    torch.testing.assert_close(edited[:, :-1], plain[:, :-1])
    assert not torch.allclose(edited[:, -1], plain[:, -1])
    with bridge.hooks([(site, zero_last)]):
        assert torch.equal(bridge.forward(_ids(0)), edited)  # the same edit under no_grad


def test_gradients_take_no_part(bridge: TransformerBridge) -> None:
    with torch.enable_grad():
        _, cache = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    assert bridge.driver.capture_arena.nbytes == 0
    _, without = bridge.run_with_cache(_ids(0), names_filter=NAMES)
    assert bridge.driver.capture_arena.nbytes > 0
    for name in NAMES:
        assert torch.equal(cache[name], without[name]), name


def test_only_a_plain_bias_free_linear_head_writes_into_the_arena() -> None:
    arena = CaptureArena()
    x = torch.randn(2, 3, 4)
    for head in (nn.Linear(4, 5, bias=True), _ScaledLinear(4, 5, bias=False)):
        with arena.forward(), head_into_arena(head, arena):
            assert "forward" not in vars(head)
            head(x)
        assert arena.nbytes == 0
    head = nn.Linear(4, 5, bias=False)
    with arena.forward(), head_into_arena(head, arena):
        out = head(x)
    assert "forward" not in vars(head)
    assert arena.nbytes == out.untyped_storage().nbytes()
    assert torch.equal(out, nn.functional.linear(x, head.weight))


class _ScaledLinear(nn.Linear):
    """A head whose forward is not nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0
