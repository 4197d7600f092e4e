"""``tl certify`` / ``tl hooks`` on folders that hold no bootable model: one ``tl: error:``
line that says what the folder is or lacks, exit code 1, never a traceback."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tl_core import ConfigError, TransformerBridge, UserError
from tl_core.cli import main
from tl_driver_hf.testing import write_tiny_default_checkpoint


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _dictionary_folder(folder: Path) -> Path:
    """A sae-lens dictionary folder: cfg.json and sae_weights.safetensors."""
    folder.mkdir()
    d_in, d_sae = 128, 16
    save_file(
        {
            "W_enc": torch.randn(d_in, d_sae),
            "b_enc": torch.zeros(d_sae),
            "W_dec": torch.randn(d_sae, d_in),
            "b_dec": torch.zeros(d_in),
        },
        str(folder / "sae_weights.safetensors"),
    )
    cfg = {"architecture": "standard", "d_in": d_in, "d_sae": d_sae, "hook_name": "blocks.0.hook_out",
           "metadata": {"model_name": "tiny-llama", "hook_name": "blocks.0.hook_out"}}  # fmt: skip
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def _without(source: Path, target: Path, *names: str) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*names))
    return target


@pytest.mark.parametrize("argv", [["certify"], ["hooks", "--model"]])
def test_a_folder_without_weights_says_so(
    argv: list[str],
    checkpoint: Callable[[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = _without(checkpoint("llama"), tmp_path / "no-weights", "*.safetensors")
    assert main([*argv, str(folder)]) == 1
    line = _one_error(capsys)
    assert f"folder {str(folder)!r} has a config.json but no weights" in line
    assert "model.safetensors" in line and re.search(r"it holds: [^;]*config\.json", line)


@pytest.mark.parametrize("argv", [["certify"], ["hooks", "--model"]])
def test_a_folder_without_config_says_so(
    argv: list[str],
    checkpoint: Callable[[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = _without(checkpoint("llama"), tmp_path / "no-config", "config.json")
    assert main([*argv, str(folder)]) == 1
    line = _one_error(capsys)
    assert f"{str(folder)!r} has no config.json, so it is no checkpoint folder" in line
    assert "model.safetensors" in line  # what it holds


def test_folders_that_hold_no_model_are_refused_in_python_too(tmp_path: Path) -> None:
    folder = _dictionary_folder(tmp_path / "sae")
    with pytest.raises(
        UserError,
        match=r"is a sparse dictionary folder .* not a model .*'tiny-llama'.*bridge\.add_sae",
    ):
        TransformerBridge.boot_transformers(str(folder))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is an empty folder"):
        TransformerBridge.boot_transformers(str(tmp_path / "empty"))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match=r"has no config\.json but holds the GGUF file 'm\.gguf'"):
        TransformerBridge.boot_transformers(str(tmp_path / "gguf"))


def test_a_broken_config_is_a_config_error(
    checkpoint: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _without(checkpoint("llama"), tmp_path / "untyped", "config.json")
    (folder / "config.json").write_text(json.dumps({"hidden_size": 128}))
    with pytest.raises(ConfigError, match=r"cannot read the config of folder .*model_type"):
        TransformerBridge.boot_transformers(str(folder))
    (folder / "config.json").write_text("{")
    assert main(["certify", str(folder)]) == 1
    assert "cannot read the config of folder" in _one_error(capsys)


def test_certify_refuses_a_config_with_more_layers_than_its_weights(
    checkpoint: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _without(checkpoint("llama"), tmp_path / "three", "nothing")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert main(["certify", str(folder)]) == 1
    line = _one_error(capsys)
    assert "lacks 9 weights" in line and "model.layers.2: all 9 of its weights" in line
    # transformers' own load report (a table) is not printed before the refusal.
    assert "LOAD REPORT" not in capsys.readouterr().err


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"])
def test_certify_runs_on_tiny_latent_attention_checkpoints(
    model_type: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_tiny_default_checkpoint(model_type, tmp_path / model_type)
    assert main(["certify", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "architecture: inferred from the module tree" in out and "FAIL" not in out
