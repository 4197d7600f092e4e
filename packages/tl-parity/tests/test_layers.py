"""``layers``: out-of-range blocks are refused, negative ones count from the end, and a run
that compared no block never passes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tl_core.cli import main
from tl_parity import _run, run_parity, run_parity_many


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a driver process would start."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a driver process was started")

    monkeypatch.setattr(_run, "run_workers", refuse)


@pytest.mark.parametrize("layers", ["7", [7], "0,7", "-3"])
def test_out_of_range_layers_are_refused_before_any_worker_starts(
    no_workers: None, layers: Any
) -> None:
    with pytest.raises(
        ValueError, match=r"'gpt2' has 2 blocks \(0\.\.1, or -2\.\.-1 counted from the end\)"
    ):
        run_parity("gpt2", candidate="native", reference="native", layers=layers, quiet=True)


def test_native_block_count_follows_the_boot_options(no_workers: None) -> None:
    with pytest.raises(ValueError, match="has 3 blocks"):
        run_parity(
            "llama",
            candidate="native",
            reference="native",
            layers="3",
            quiet=True,
            candidate_options={"n_layers": 3},
            reference_options={"n_layers": 3},
        )


def test_hf_folder_block_count_comes_from_its_config(
    no_workers: None, tiny: Callable[[str], Path]
) -> None:
    folder = tiny("llama")
    with pytest.raises(ValueError, match=r"has 2 blocks"):
        run_parity_many([folder], candidate="hf", reference="hf", layers="2", quiet=True)


def test_the_cli_reports_out_of_range_layers_in_one_line(
    no_workers: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "parity",
            "--model",
            "gpt2",
            "--candidate",
            "native",
            "--reference",
            "native",
            "--layers",
            "7",
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and err.startswith("tl: error: layers '7'"), err
    assert "block 7" in err and "has 2 blocks" in err


def _outcome(requested: list[str], n_layers: int = 2) -> Any:
    """A canned worker outcome: every requested hook equal on both sides."""
    import torch

    tensors = {f"hook::{n}": torch.ones(1, 3, 4) for n in requested}
    meta = {
        "lengths": [3],
        "requested": requested,
        "layouts": {n: "b p d" for n in requested},
        "non_fireable": {},
        "info": {"n_layers": n_layers},
        "provides_sequence_logits": False,
    }
    return (meta, tensors, meta, tensors)


def test_a_run_that_compared_no_block_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The count is unknown before booting (a hub id), and the drivers served no hook in
    # the selected blocks: the rows outside the blocks must not make it a PASS.
    monkeypatch.setattr(
        _run, "run_workers", lambda *a, **k: [_outcome(["embed.hook_out", "unembed.hook_out"])]
    )
    report = run_parity(
        "org/some-model", candidate="native", reference="native", layers="1", quiet=True
    )
    assert not report.passed
    assert report.error is not None
    assert (
        "layers '1'" in report.error
        and "no block hook" in report.error
        and "2 blocks" in report.error
    )
    monkeypatch.setattr(
        _run, "run_workers", lambda *a, **k: [_outcome(["embed.hook_out", "blocks.1.hook_out"])]
    )
    assert run_parity(
        "org/some-model", candidate="native", reference="native", layers="1", quiet=True
    ).passed


def test_negative_layers_parse_and_select_from_the_end() -> None:
    from tl_parity._run import _layers
    from tl_parity._worker import _select

    assert _layers("-1") == [-1] and _layers("0,-1") == [-1, 0]
    served = ["embed.hook_out", "blocks.0.hook_out", "blocks.1.hook_out", "unembed.hook_out"]
    assert _select(served, [-1], n_layers=2) == [
        "embed.hook_out",
        "blocks.1.hook_out",
        "unembed.hook_out",
    ]
    assert _select(served, [0, -2], n_layers=2) == [
        "embed.hook_out",
        "blocks.0.hook_out",
        "unembed.hook_out",
    ]
    with pytest.raises(ValueError, match="has 2 blocks"):
        _select(served, [2], n_layers=2)


@pytest.mark.slow
def test_negative_layer_compares_the_last_block() -> None:
    report = run_parity("gpt2", candidate="native", reference="native", layers="-1", quiet=True)
    assert report.passed, (report.error, report.failures)
    assert {r.layer for r in report.hooks} == {None, 1}


@pytest.mark.slow
def test_a_count_unknown_before_booting_is_checked_by_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # raising=False: the name is also missing where nothing checks the count (the old code).
    monkeypatch.setattr(_run, "declared_blocks", lambda *a, **k: None, raising=False)
    report = run_parity("gpt2", candidate="native", reference="native", layers="7", quiet=True)
    assert not report.passed and report.hooks == []
    assert (
        report.error is not None
        and "LayerRangeError" in report.error
        and "has 2 blocks" in report.error
    )
