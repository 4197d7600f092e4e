"""Bad driver names, alias generations and model paths are refused before any process starts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tl_core._errors import DriverNotFoundError, UserError
from tl_core.cli import main
from tl_core.driver_api import looks_like_path
from tl_parity import _run, run_parity
from tl_parity._checks import check_model


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a driver process would start."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a driver process was started")

    monkeypatch.setattr(_run, "run_workers", refuse)


@pytest.fixture
def no_boot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a model would boot in this process."""
    import tl_core

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was booted")

    monkeypatch.setattr(tl_core, "boot", refuse)


@pytest.mark.parametrize("role", ["candidate", "reference"])
def test_a_misspelt_driver_is_refused_with_did_you_mean(no_workers: None, role: str) -> None:
    drivers = {"candidate": "native", "reference": "native", role: "nativ"}
    with pytest.raises(
        DriverNotFoundError,
        match=rf"the {role} driver 'nativ' cannot run: .*did you mean 'native'\?",
    ):
        run_parity("gpt2", quiet=True, **drivers)


def test_a_known_driver_that_is_not_installed_names_its_package(
    no_workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tl_core.driver_api import _discovery

    installed = {k: v for k, v in _discovery.available_drivers().items() if k != "vllm"}
    monkeypatch.setattr(_discovery, "available_drivers", lambda: installed)
    with pytest.raises(
        DriverNotFoundError, match=r"installed drivers: .*native.*pip install tl-driver-vllm"
    ):
        run_parity("gpt2", candidate="vllm", reference="native", quiet=True)


def test_the_cli_reports_a_bad_driver_in_one_line(
    no_workers: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["parity", "--model", "gpt2", "--candidate", "natve", "--reference", "native", "--quiet"]
    )
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert (
        err.startswith("tl: error: the candidate driver 'natve' cannot run")
        and "did you mean 'native'?" in err
    )


@pytest.mark.parametrize(
    "model", ["./no-such-checkpoint", "/no/such/folder", "~/no-such-tl-folder", "./weights.gguf"]
)
def test_a_path_that_does_not_exist_is_refused(no_workers: None, model: str) -> None:
    what = "file" if model.endswith(".gguf") else "folder"
    with pytest.raises(
        UserError,
        match=rf"model={re.escape(repr(model))} is a path, but {what} '/.*' does not exist",
    ):
        run_parity(model, candidate="native", reference="native", quiet=True)


def test_the_cli_reports_a_missing_folder_in_one_line(
    no_workers: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "tiny-llama"
    assert (
        main(
            [
                "parity",
                "--model",
                str(missing),
                "--candidate",
                "native",
                "--reference",
                "native",
                "--quiet",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        f"tl: error: model={str(missing)!r} is a path, but folder {str(missing)!r} does not exist"
    )


@pytest.mark.parametrize("model", ["gpt2", "org/name", "HuggingFaceTB/SmolLM2-135M"])
def test_hub_ids_and_presets_are_not_paths(model: str) -> None:
    assert not looks_like_path(model)
    check_model(model)  # nothing to check without booting


def test_an_existing_folder_passes(tmp_path: Path) -> None:
    assert looks_like_path(str(tmp_path))
    check_model(tmp_path)
    check_model(str(tmp_path))


def test_a_file_that_is_no_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        UserError,
        match=rf"is a file, but a model loads from .*: pass the folder that holds it, '{tmp_path}'",
    ):
        check_model(str(tmp_path / "config.json"))


def test_a_missing_prompts_file_is_refused(no_workers: None, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"prompts file '.*nope.txt' does not exist .*one prompt a line"
    ):
        run_parity(
            "gpt2",
            candidate="native",
            reference="native",
            prompts=str(tmp_path / "nope.txt"),
            quiet=True,
        )


def test_an_unknown_alias_generation_is_refused_before_booting(
    no_boot: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["parity", "--aliases", "nnterpp", "--model", "gpt2", "--candidate", "native"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "tl: error: --aliases: unknown naming generation 'nnterpp'; did you mean 'nnterp'?"
    )
    assert "transformer_lens_2, transformer_lens_4, nnterp, interp_engine" in err


def test_the_alias_report_checks_driver_and_model_before_booting(
    no_boot: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["parity", "--aliases", "nnterp", "--model", "gpt2", "--candidate", "hff"]) == 1
    assert "the candidate driver 'hff' cannot run" in capsys.readouterr().err
    assert (
        main(["parity", "--aliases", "nnterp", "--model", "./missing", "--candidate", "native"])
        == 1
    )
    assert "model='./missing' is a path, but folder" in capsys.readouterr().err


def test_the_card_refuses_unknown_drivers_and_families_before_running(
    no_workers: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "parity",
                "--candidate",
                "all",
                "--reference",
                "native",
                "--drivers",
                "inspekt",
                "--quiet",
            ]
        )
        == 1
    )
    assert "--drivers: no tl driver named 'inspekt'" in capsys.readouterr().err
    pytest.importorskip("tl_driver_hf.testing", reason="pip install tl-driver-hf")
    code = main(
        [
            "parity",
            "--candidate",
            "all",
            "--drivers",
            "native",
            "--families",
            "lama",
            "--cache-dir",
            str(tmp_path),
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "--families: unknown tiny families 'lama' (did you mean 'llama'?)" in err
    assert not any(tmp_path.iterdir())  # no checkpoint written either
