"""Which bridge paths ask a remote engine for logits: only those that use them.

A serving engine computes sequence logits on purpose (vLLM only computes the sampled
row), and ships ``[batch, pos, vocab]`` between processes: a run that only captures must
not ask for them. Each path runs against the fake remote driver, whose ``run`` calls are
recorded.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tl_core import RemoteBridge
from tl_core.capture import CaptureConfig, capture

try:
    metadata.version("tl-fake-driver")
except metadata.PackageNotFoundError:
    pytest.skip("the fake remote driver is installed by `nox -s tests`", allow_module_level=True)


@pytest.fixture(scope="module")
def remote() -> Iterator[RemoteBridge]:
    bridge = RemoteBridge.boot("llama", driver="fake", n_layers=2, seed=4)
    yield bridge
    bridge.close()


@pytest.fixture
def asked(remote: RemoteBridge, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Whether each engine call the bridge makes asks for logits."""
    calls: list[Any] = []
    original = remote.driver.run

    def spy(request: Any) -> Any:
        calls.append(request.logits != "none")
        return original(request)

    monkeypatch.setattr(remote.driver, "run", spy)
    return calls


HOOK = "blocks.1.hook_resid_post"
PATHS: dict[str, tuple[Callable[[RemoteBridge], Any], bool]] = {
    "forward(return_type=None)": (lambda m: m.forward("some text", None), False),
    "run_with_cache(return_type=None)": (
        lambda m: m.run_with_cache("some text", names_filter=[HOOK], return_type=None),
        False,
    ),
    "run_with_cache(stop_at_layer=1) (sae-lens)": (
        lambda m: m.run_with_cache(
            "some text",
            names_filter=["blocks.0.hook_resid_post"],
            stop_at_layer=1,
            prepend_bos=False,
        ),
        False,
    ),
    "forward(stop_at_layer=1)": (lambda m: m.forward("some text", stop_at_layer=1), False),
    "generate": (lambda m: m.generate("some text", max_new_tokens=2), False),
    "forward()": (lambda m: m.forward("some text"), True),
    "loss": (lambda m: m.loss("some text"), True),
    "run_with_cache()": (lambda m: m.run_with_cache("some text", names_filter=[HOOK]), True),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_logits_are_asked_for_only_where_they_are_used(
    path: str, remote: RemoteBridge, asked: list[Any]
) -> None:
    call, wanted = PATHS[path]
    call(remote)
    assert asked and all(a is wanted for a in asked), (
        f"{path}: logits asked={asked}, expected {wanted}"
    )


def test_a_capture_job_asks_for_no_logits(
    remote: RemoteBridge, asked: list[Any], tmp_path: Path
) -> None:
    source = tmp_path / "docs.txt"
    source.write_text("the cat sat on the mat\nbirds sang in old trees while dogs ran\n" * 4)
    job = CaptureConfig(
        model="llama",
        driver="fake",
        hooks=(HOOK,),
        input=str(source),
        context_size=8,
        batch_size=2,
    )
    summary = capture(job, tmp_path / "store", bridge=remote, progress=False)
    assert summary.rows_written > 0
    assert len(asked) >= 2 and all(a is False for a in asked), asked
