"""The report card SKIPs only refusals of architectures a driver does not declare.

A driver that refuses, at boot, an architecture it declares (its class's
``supported_architectures``, or a first-party driver's family table) is a FAIL, and so is
any boot failure that is not a refusal (``ConfigError``/``UnsupportedFeatureError``).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tl_core._errors import ConfigError, UnsupportedFeatureError
from tl_core.cli import main
from tl_parity import ParityReport
from tl_parity._card import _row
from tl_parity._declared import boot_failure_facts, declared_architectures

LLAMA = "LlamaForCausalLM"


def _failed(message: str, facts: dict[str, Any] | None, side: str = "candidate") -> ParityReport:
    extra = {"failure": {"side": side, **facts}} if facts is not None else {}
    return ParityReport(
        model="m",
        reference="hf",
        candidate="refuser",
        dtype="float32",
        hooks=[],
        logits=None,
        argmax_agreement=None,
        non_fireable={},
        error=f"{side} 'refuser' failed: {message}",
        extra=extra,
    )


def _facts(
    error_type: str,
    *,
    stage: str = "boot",
    declared: bool | None = False,
    architecture: str | None = LLAMA,
) -> dict[str, Any]:
    refusal = stage == "boot" and error_type in ("ConfigError", "UnsupportedFeatureError")
    return {
        "stage": stage,
        "error_type": error_type,
        "error_types": [error_type],
        "refusal": refusal,
        "architecture": architecture if refusal else None,
        "declared": declared if refusal else None,
    }


@pytest.mark.parametrize(
    ("facts", "status", "detail"),
    [
        (_facts("ConfigError", declared=False), "SKIP", "ConfigError: no"),
        (_facts("UnsupportedFeatureError", declared=False), "SKIP", "UnsupportedFeatureError: no"),
        (
            _facts("ConfigError", declared=True),
            "FAIL",
            "refused 'LlamaForCausalLM' at boot, although the driver declares it supported: ConfigError: no",
        ),
        (_facts("ConfigError", declared=None), "SKIP", "declares no supported_architectures"),
        (
            _facts("ConfigError", declared=None, architecture=None),
            "SKIP",
            "the checkpoint names no architecture",
        ),
        (_facts("RuntimeError"), "FAIL", "candidate 'refuser' failed: RuntimeError: no"),
        (_facts("NotImplementedError"), "FAIL", "NotImplementedError"),
        (_facts("ConfigError", stage="run"), "FAIL", "candidate 'refuser' failed"),
        (None, "FAIL", "candidate 'refuser' failed"),  # a crash: no facts at all
    ],
)
def test_which_failures_skip(facts: dict[str, Any] | None, status: str, detail: str) -> None:
    error_type = facts["error_type"] if facts else "ConfigError"
    row = _row("refuser", "llama", _failed(f"{error_type}: no", facts))
    assert (row.status, detail in row.detail) == (status, True), row


def test_a_reference_failure_skips() -> None:
    row = _row(
        "refuser", "llama", _failed("RuntimeError: boom", _facts("RuntimeError"), side="reference")
    )
    assert row.status == "SKIP" and row.detail.startswith("reference cannot run it")


def test_the_failure_facts_survive_the_json_report() -> None:
    report = _failed("ConfigError: no", _facts("ConfigError", declared=True))
    again = ParityReport.from_dict(json.loads(report.to_json()))
    assert _row("refuser", "llama", again).status == "FAIL"


# -- what a driver declares, read in-process from a monkeypatched driver entry ---------------


class _Refuser:
    """Declares Llama and refuses everything at boot."""

    supported_architectures = (LLAMA,)

    @classmethod
    def boot(cls, model: Any = None, **options: Any) -> Any:
        raise ConfigError(f"the refuser driver does not serve {model!r}")


@pytest.fixture
def refuser_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_driver_entry("refuser")`` names ``_Refuser`` (an in-process module)."""
    import tl_core.driver_api
    from tl_core.driver_api import DriverEntry

    module = types.ModuleType("tl_parity_test_refuser")
    module.Refuser = _Refuser  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    entry = DriverEntry(
        name="refuser", distribution="test", loader=f"{module.__name__}:Refuser", kind="remote"
    )
    real = tl_core.driver_api.get_driver_entry
    monkeypatch.setattr(
        tl_core.driver_api,
        "get_driver_entry",
        lambda name: entry if name == "refuser" else real(name),
    )


def _checkpoint(folder: Path, architecture: str) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": [architecture]}), encoding="utf-8"
    )
    return str(folder)


def test_a_refusal_of_a_declared_architecture_is_marked_declared(
    refuser_entry: None, tmp_path: Path
) -> None:
    assert declared_architectures("refuser") == frozenset({LLAMA})
    for arch, declared in ((LLAMA, True), ("GPT2LMHeadModel", False)):
        model = _checkpoint(tmp_path / arch, arch)
        with pytest.raises(ConfigError) as exc:
            _Refuser.boot(model)
        facts = boot_failure_facts(exc.value, stage="boot", driver="refuser", model=model)
        assert facts["refusal"] and facts["architecture"] == arch and facts["declared"] is declared
        status = _row("refuser", arch, _failed(f"ConfigError: {exc.value}", facts)).status
        assert status == ("FAIL" if declared else "SKIP")


def test_a_subclass_of_a_refusal_counts_and_other_errors_do_not(
    refuser_entry: None, tmp_path: Path
) -> None:
    class NoFlashAttention(UnsupportedFeatureError):
        pass

    model = _checkpoint(tmp_path / "llama", LLAMA)
    facts = boot_failure_facts(NoFlashAttention("x"), stage="boot", driver="refuser", model=model)
    assert (
        facts["error_types"][:2] == ["NoFlashAttention", "UnsupportedFeatureError"]
        and facts["declared"] is True
    )
    facts = boot_failure_facts(MemoryError("x"), stage="boot", driver="refuser", model=model)
    assert not facts["refusal"] and facts["declared"] is None


def test_first_party_family_tables_are_declarations() -> None:
    hf = pytest.importorskip("tl_driver_hf.adapters", reason="pip install tl-driver-hf")
    declared = declared_architectures("hf")
    assert declared is not None and LLAMA in declared and "GPTNeoForCausalLM" in declared
    assert declared == {a for adapter in hf.all_adapters() for a in adapter.architectures}
    assert declared_architectures("inspect") == declared  # inspect runs the hf driver by default
    assert declared_architectures("native") is None


# -- end to end: a real entry point, booted by the card's driver processes --------------------

_DRIVER = """
from tl_core import ConfigError
from tl_core.driver_api import DriverEntry

ENTRY = DriverEntry(name="refuser", distribution="tl-parity-refuser", kind="remote",
                    loader="tl_parity_refuser:RefuserDriver", description="declares llama, refuses all")


class RefuserDriver:
    supported_architectures = ("LlamaForCausalLM",)

    @classmethod
    def boot(cls, model=None, **options):
        raise ConfigError(f"the refuser driver does not serve {model!r}")
"""


@pytest.fixture
def refuser_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A ``refuser`` driver with a real ``tl_core.drivers`` entry point, on this test's path only."""
    from tl_core.driver_api import clear_driver_cache

    site = tmp_path / "site"
    info = site / "tl_parity_refuser-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tl-parity-refuser\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tl_core.drivers]\nrefuser = tl_parity_refuser:ENTRY\n")
    (site / "tl_parity_refuser.py").write_text(textwrap.dedent(_DRIVER))
    monkeypatch.syspath_prepend(str(site))
    # The driver processes find it too (they inherit this environment).
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    )
    clear_driver_cache()
    yield
    clear_driver_cache()


@pytest.mark.slow
def test_the_card_fails_a_driver_that_refuses_a_family_it_declares(
    refuser_distribution: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip(
        "tl_driver_hf.testing", reason="the reference and tiny checkpoints need tl-driver-hf"
    )
    code = main(
        [
            "parity",
            "--candidate",
            "all",
            "--drivers",
            "refuser",
            "--families",
            "llama,gpt2",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    rows = {
        cells[1]: cells for ln in out.splitlines() if (cells := ln.split(None, 3))[0] == "refuser"
    }
    assert code == 1, out
    assert (
        rows["llama"][2] == "FAIL"
        and "refused 'LlamaForCausalLM' at boot, although the driver declares it"
        in rows["llama"][3]
    )
    assert (
        rows["gpt2"][2] == "SKIP"
        and "ConfigError: the refuser driver does not serve" in rows["gpt2"][3]
    )
    assert "report card vs 'hf': 0 PASS, 1 FAIL, 1 SKIP" in out
