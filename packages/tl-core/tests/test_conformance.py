"""``check_driver`` passes on the built-in drivers and fails on drivers that break promises."""

from __future__ import annotations

import importlib.metadata as metadata
from typing import Any

import pytest
import torch

from tl_core import DriverContractError
from tl_core.driver_api import ForwardResult, build_request, check_driver
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
    """Wraps a driver and drops every spec: the check must notice."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def forward(self, input_ids: Any, **kwargs: Any) -> ForwardResult:
        kwargs.pop("intervene", None)
        return self._inner.forward(input_ids, **kwargs)  # type: ignore[no-any-return]


class _ValidatesThenIgnoresSpecs(_IgnoresSpecs):
    """Refuses bad specs like a real driver, then runs without the good ones."""

    def forward(self, input_ids: Any, **kwargs: Any) -> ForwardResult:
        if kwargs.get("intervene") is not None:
            build_request(self._inner, input_ids, intervene=kwargs["intervene"])
        return super().forward(input_ids, **kwargs)


class _DropsAHook(_IgnoresSpecs):
    def forward(self, input_ids: Any, **kwargs: Any) -> ForwardResult:
        result = self._inner.forward(input_ids, **kwargs)
        captured = {k: v for k, v in result.captured.items() if k != "blocks.1.hook_out"}
        return ForwardResult(result.logits, captured, result.new_tokens, None, result.lengths)


class _DropsAnOption(_IgnoresSpecs):
    """Runs without one sampling option, as a driver that never reads it would."""

    option = ""

    def forward(self, input_ids: Any, **kwargs: Any) -> ForwardResult:
        kwargs.pop(self.option, None)
        return self._inner.forward(input_ids, **kwargs)  # type: ignore[no-any-return]


class _PaddingReachesRealPositions(_IgnoresSpecs):
    """Hands shorter rows back shifted right, as a driver that left-pads and forgets the offset."""

    def forward(self, input_ids: Any, **kwargs: Any) -> ForwardResult:
        result = self._inner.forward(input_ids, **kwargs)
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
        (_IgnoresSpecs, "accepted a spec on read-only"),
        (_ValidatesThenIgnoresSpecs, "left non-zero values"),
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
