"""``check_driver`` passes on the built-in drivers and fails on drivers that break promises."""

from __future__ import annotations

import dataclasses
import importlib.metadata as metadata
from typing import Any

import pytest
import torch

from tl_core import DriverContractError
from tl_core.driver_api import (
    ForwardRequest,
    ForwardResult,
    InterventionPlan,
    SamplingOptions,
    check_driver,
)
from tl_core.native import NativeDriver


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_native_driver_keeps_the_contract(preset: str) -> None:
    check_driver(NativeDriver.boot(preset, n_layers=2))


def _fake() -> Any:
    try:
        metadata.version("tl-fake-driver")
    except metadata.PackageNotFoundError:
        pytest.skip("the fake remote driver is installed by `nox -s tests`")
    from tl_fake_driver._driver import FakeRemoteDriver

    return FakeRemoteDriver.boot("llama", n_layers=2)


def test_remote_style_driver_keeps_the_contract() -> None:
    check_driver(_fake())


class _IgnoresSpecs:
    """Wraps a driver and drops every spec: the check must notice.

    (A driver no longer validates names or specs: the request reaches ``run`` checked, so
    a driver that accepted a spec on a read-only hook is a failure mode that is gone.)
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def run(self, request: ForwardRequest) -> ForwardResult:
        unedited = InterventionPlan(per_prompt=tuple({} for _ in request.lengths))
        return self._inner.run(dataclasses.replace(request, plan=unedited))  # type: ignore[no-any-return]


class _DropsAHook(_IgnoresSpecs):
    def run(self, request: ForwardRequest) -> ForwardResult:
        result = self._inner.run(request)
        captured = {k: v for k, v in result.captured.items() if k != "blocks.1.hook_out"}
        return ForwardResult(result.logits, captured, result.new_tokens, None, result.lengths)


class _DropsAnOption(_IgnoresSpecs):
    """Runs without one sampling option, as a driver that never reads it would."""

    option = ""

    def run(self, request: ForwardRequest) -> ForwardResult:
        kept = request.sampling.keywords()
        kept[self.option] = SamplingOptions().keywords()[self.option]
        unread = dataclasses.replace(request, sampling=SamplingOptions(**kept))
        return self._inner.run(unread)  # type: ignore[no-any-return]


class _PaddingReachesRealPositions(_IgnoresSpecs):
    """Hands shorter rows back shifted right, as a driver that left-pads and forgets the offset."""

    def run(self, request: ForwardRequest) -> ForwardResult:
        result = self._inner.run(request)
        longest = max(result.lengths)
        captured = {
            name: torch.stack(
                [row.roll(longest - length, dims=0) if row.ndim >= 2 else row
                 for row, length in zip(value, result.lengths, strict=True)]
            ) if name == "blocks.0.attn.hook_out" else value
            for name, value in result.captured.items()
        }  # fmt: skip
        return ForwardResult(result.logits, captured, result.new_tokens, None, result.lengths)


def _dropping(option: str) -> type:
    return type(f"_Drops_{option}", (_DropsAnOption,), {"option": option})


@pytest.mark.parametrize(
    ("wrapper", "message"),
    [
        (_IgnoresSpecs, "left non-zero values"),
        (_DropsAHook, "returned no tensor"),
        (_PaddingReachesRealPositions, "prompt 2 run alone gives another 'blocks.0.attn.hook_out'"),
        (_dropping("do_sample"), "it ignores do_sample"),
        (_dropping("seed"), "it ignores seed"),
        (_dropping("top_k"), "it ignores top_k"),
        (_dropping("top_p"), "it ignores top_p"),
    ],
)
def test_a_driver_that_breaks_a_promise_fails(wrapper: type, message: str) -> None:
    with pytest.raises(DriverContractError, match=message):
        check_driver(wrapper(NativeDriver.boot("gpt2", n_layers=2)))
