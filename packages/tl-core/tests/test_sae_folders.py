"""Reading sae-lens's dictionary folders as sae-lens 6.54 reads them, and refusing, with a tl
error naming the file, every folder it cannot read exactly: bad JSON, damaged safetensors,
sizes the weights contradict, tensors the architecture does not have (a JumpReLU threshold
under a config that names no architecture), NaN or integer weights, architectures tl does
not run, single-head dictionaries.

sae-lens's own ``SAE.load_from_disk`` and ``SAE.forward`` are the reference in
``tests-peers/sae_lens/test_folders_as_sae_lens_reads_them.py``; these need only tl-core.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import save_file

from tl_core import ConfigError, TLError, TransformerBridge, UnsupportedFeatureError
from tl_core.cli import main
from tl_core.sae import SparseDictionary, load_dictionary, random_dictionary

VERSION = {"sae_lens_version": "6.54.12"}


def _tensors(d: SparseDictionary) -> dict[str, torch.Tensor]:
    names = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")
    return {n: getattr(d, n) for n in names if getattr(d, n) is not None}


def _save(folder: Path, cfg: Any, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / "sae_weights.safetensors")
    )
    return folder


def _cfg(d: SparseDictionary, architecture: str = "standard", **extra: Any) -> dict[str, Any]:
    return {
        "d_in": d.d_in,
        "d_sae": d.d_sae,
        "architecture": architecture,
        "metadata": dict(VERSION),
        **extra,
    }


def test_a_jumprelu_folder_without_its_architecture_is_refused_as_sae_lens_refuses_it(
    tmp_path: Path,
) -> None:
    d = random_dictionary(8, 32, architecture="jumprelu")
    cfg = _cfg(d, "jumprelu")
    # As sae-lens 6 saved it, less the key: sae-lens itself fails on the missing key.
    del cfg["architecture"]
    with pytest.raises(
        ConfigError,
        match=r"cfg\.json: the config was saved by sae-lens 6\.x but names no architecture",
    ):
        load_dictionary(_save(tmp_path / "v6", cfg, _tensors(d)))
    # Without a version it is an older config: sae-lens defaults it to standard, and refuses
    # the threshold the standard architecture has no place for. It was read as a ReLU SAE.
    old = {"d_in": 8, "d_sae": 32, "hook_point": "blocks.0.hook_resid_post"}
    weights = tmp_path / "old" / "sae_weights.safetensors"
    with pytest.raises(
        ConfigError,
        match=re.escape(f"{weights}: a 'standard' dictionary has the tensors W_enc, b_enc, W_dec, b_dec, "
                        "but the file holds threshold, which it does not use"),
    ):  # fmt: skip
        load_dictionary(_save(tmp_path / "old", old, _tensors(d)))


def test_an_older_config_gets_sae_lens_defaults(tmp_path: Path) -> None:
    d = random_dictionary(8, 32, architecture="topk", k=5)
    plain = {k: v for k, v in _tensors(d).items()}
    topk = load_dictionary(
        _save(tmp_path / "topk", {"d_in": 8, "d_sae": 32, "activation_fn_str": "topk",
                                  "activation_fn_kwargs": {"k": 5}, "hook_point": "blocks.1.hook_resid_pre",
                                  "normalize_activations": True}, plain)
    )  # fmt: skip
    assert (topk.architecture, topk.k, topk.hook_name) == ("topk", 5, "blocks.1.hook_resid_pre")
    assert topk.normalize_activations == "none"  # sae-lens folds the old True in at inference
    x = torch.randn(4, 8)
    torch.testing.assert_close(topk.reconstruct(x), d.reconstruct(x))
    # A stray k under a standard config is ignored as sae-lens ignores it (no field for it).
    standard = load_dictionary(
        _save(tmp_path / "standard", {"d_in": 8, "d_sae": 32, "k": 5}, plain)
    )
    assert standard.architecture == "standard" and standard.k is None
    z = load_dictionary(_save(tmp_path / "z", {"hook_point": "blocks.0.attn.hook_z"}, plain))
    assert z.flatten_heads  # sae-lens's default reshape for an older hook_z config


def test_an_older_jumprelu_log_threshold_becomes_its_threshold(tmp_path: Path) -> None:
    d = random_dictionary(8, 32, architecture="jumprelu")
    tensors = _tensors(d)
    tensors["log_threshold"] = tensors.pop("threshold").clamp_min(1e-3).log()
    loaded = load_dictionary(_save(tmp_path / "sae", _cfg(d, "jumprelu"), tensors))
    assert loaded.threshold is not None
    torch.testing.assert_close(loaded.threshold, tensors["log_threshold"].exp())


@pytest.mark.parametrize(
    ("key", "value", "actual"),
    [("d_in", 9, 8), ("d_sae", 31, 32), ("d_out", 6, 8), ("d_in", None, 8)],
)
def test_config_sizes_the_weights_contradict_are_refused(
    tmp_path: Path, key: str, value: Any, actual: int
) -> None:
    d = random_dictionary(8, 32)
    folder = _save(tmp_path / "sae", _cfg(d, **{key: value}), _tensors(d))
    with pytest.raises(
        ConfigError,
        match=re.escape(f"{folder / 'cfg.json'}: the config's sizes disagree with the weights "
                        f"({key}={value!r} but the weights have {actual}"),
    ):  # fmt: skip
        load_dictionary(folder)


def test_nan_and_integer_weights_in_a_folder_are_refused_naming_the_file(tmp_path: Path) -> None:
    d = random_dictionary(8, 32)
    tensors = _tensors(d)
    tensors["W_dec"] = tensors["W_dec"].clone()
    tensors["W_dec"][4, 1] = float("inf")
    folder = _save(tmp_path / "inf", _cfg(d), tensors)
    with pytest.raises(ConfigError, match=re.escape(f"{folder / 'sae_weights.safetensors'}: this sparse dictionary is inconsistent: W_dec holds inf at 1 of 256 entries (the first at index (4, 1))")):  # fmt: skip
        load_dictionary(folder)
    ints = {k: (v * 10).to(torch.int32) for k, v in _tensors(d).items()}
    folder = _save(tmp_path / "int", _cfg(d), ints)
    with pytest.raises(
        ConfigError,
        match=r"sae_weights\.safetensors: .*W_enc has dtype torch\.int32, not a floating-point one",
    ):
        load_dictionary(folder)


@pytest.mark.parametrize(
    ("architecture", "tensors"),
    [
        ("gated", ("W_enc", "W_dec", "b_dec", "b_gate", "b_mag", "r_mag")),
        ("matching_pursuit", ("W_dec", "b_dec")),
    ],
)
def test_architectures_tl_does_not_run_are_named_not_blamed_on_a_tensor(
    tmp_path: Path, architecture: str, tensors: tuple[str, ...]
) -> None:
    folder = _save(tmp_path / architecture, {"d_in": 8, "d_sae": 32, "architecture": architecture,
                                            "metadata": VERSION}, {n: torch.zeros(8, 8) for n in tensors})  # fmt: skip
    with pytest.raises(
        UnsupportedFeatureError,
        match=rf"cfg\.json: architecture '{architecture}' is not supported by tl",
    ):
        load_dictionary(folder)


def test_a_single_head_dictionary_is_refused_for_its_head_not_its_flattening(
    tmp_path: Path,
) -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=1, seed=0)
    d = random_dictionary(bridge.cfg.d_head, 16)
    cfg = _cfg(d, metadata={**VERSION, "hook_name": "blocks.0.attn.hook_z", "hook_head_index": 1})
    loaded = load_dictionary(_save(tmp_path / "head", cfg, _tensors(d)))
    assert loaded.hook_head_index == 1
    with pytest.raises(
        UnsupportedFeatureError,
        match=r"head 1 of 'blocks\.0\.attn\.hook_z' alone \(sae-lens's hook_head_index=1\)",
    ):
        bridge.add_sae(loaded)


def _damaged(folder: Path, how: str) -> Path:
    if how == "truncated cfg":
        text = (folder / "cfg.json").read_text()
        (folder / "cfg.json").write_text(text[: len(text) // 2])
    elif how == "list cfg":
        (folder / "cfg.json").write_text("[1, 2]")
    elif how == "truncated weights":
        data = (folder / "sae_weights.safetensors").read_bytes()
        (folder / "sae_weights.safetensors").write_bytes(data[: len(data) - 7])
    else:
        (folder / "sae_weights.safetensors").write_bytes(b"not a safetensors file")
    return folder


@pytest.mark.parametrize(
    ("how", "file", "message"),
    [
        (
            "truncated cfg",
            "cfg.json",
            r"is not valid JSON \(Unterminated string|is not valid JSON \(",
        ),
        ("list cfg", "cfg.json", r": the config is a JSON list, not an object of settings"),
        ("truncated weights", "sae_weights.safetensors", r" is not a readable safetensors file \("),
        ("garbage weights", "sae_weights.safetensors", r" is not a readable safetensors file \("),
    ],
)
def test_damaged_files_are_refused_naming_the_file(
    tmp_path: Path, how: str, file: str, message: str
) -> None:
    d = random_dictionary(8, 32)
    folder = _damaged(_save(tmp_path / "sae", _cfg(d), _tensors(d)), how)
    with pytest.raises(ConfigError, match=re.escape(str(folder / file)) + message):
        load_dictionary(folder)


def test_the_capture_command_prints_one_line_for_a_damaged_folder(
    tmp_path: Path, write_documents: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    d = random_dictionary(64, 32)
    folder = _damaged(_save(tmp_path / "sae", _cfg(d), _tensors(d)), "garbage weights")
    args = ["capture", "run", "--model", "gpt2", "--driver", "native", "--option", "n_layers=1",
            "--sae", f"{folder}@blocks.0.hook_out", "--hooks", "blocks.0.hook_out",
            "--input", str(write_documents(tmp_path / "docs.txt")), "--output", str(tmp_path / "store")]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"tl: error: {folder / 'sae_weights.safetensors'} is not a readable safetensors file"
    )
    assert "Traceback" not in err and len(err.splitlines()) == 1


# -- property: any corruption of any folder -----------------------------------------------

_CORRUPTIONS = ("none", "truncate cfg", "cfg json", "truncate weights", "flip header byte",
                "drop tensor", "extra tensor", "size", "no architecture", "int dtype", "nan")  # fmt: skip


@st.composite
def _folder_cases(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["standard", "jumprelu", "topk", "transcoder", "skip_transcoder",
                                 "jumprelu_transcoder", "jumprelu_skip_transcoder"]))  # fmt: skip
    return {
        "kind": kind, "d_in": draw(st.integers(1, 10)), "d_sae": draw(st.integers(1, 24)),
        "d_out": draw(st.integers(1, 10)), "seed": draw(st.integers(0, 999)),
        "corruption": draw(st.sampled_from(_CORRUPTIONS)), "at": draw(st.floats(0, 1)),
        "byte": draw(st.integers(0, 255)),
        "cfg_value": draw(st.sampled_from([[], 3, "x", None, [{"d_in": 1}]])),
    }  # fmt: skip


def _original(case: dict[str, Any]) -> tuple[SparseDictionary, dict[str, Any]]:
    kind = case["kind"]
    architecture = {"topk": "topk"}.get(kind, "jumprelu" if "jumprelu" in kind else "standard")
    transcoder = "transcoder" in kind
    options: dict[str, Any] = {"architecture": architecture}
    if architecture == "topk":
        options["k"] = max(1, case["d_sae"] // 2)
    if transcoder:
        options["apply_b_dec_to_input"] = False
    d = random_dictionary(
        case["d_in"], case["d_sae"], d_out=case["d_out"] if transcoder else None,
        seed=case["seed"], skip="skip" in kind, **options,
    )  # fmt: skip
    cfg = {"d_in": d.d_in, "d_sae": d.d_sae, "architecture": kind, "metadata": dict(VERSION),
           "apply_b_dec_to_input": d.apply_b_dec_to_input, **({"k": d.k} if d.k else {}),
           **({"d_out": d.d_out} if transcoder else {})}  # fmt: skip
    return d, cfg


def _corrupt(
    folder: Path, case: dict[str, Any], cfg: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    how, at = case["corruption"], case["at"]
    names = sorted(tensors)
    chosen = names[int(at * (len(names) - 1))]
    if how == "truncate cfg":
        text = json.dumps(cfg)
        cfg_text = text[: int(at * (len(text) - 1))]
        (folder / "cfg.json").write_text(cfg_text)
    elif how == "cfg json":
        (folder / "cfg.json").write_text(json.dumps(case["cfg_value"]))
    elif how == "truncate weights":
        data = (folder / "sae_weights.safetensors").read_bytes()
        (folder / "sae_weights.safetensors").write_bytes(data[: int(at * (len(data) - 1))])
    elif how == "flip header byte":
        data = bytearray((folder / "sae_weights.safetensors").read_bytes())
        header = 8 + int.from_bytes(data[:8], "little")
        data[int(at * (header - 1))] = case["byte"]
        (folder / "sae_weights.safetensors").write_bytes(bytes(data))
    elif how in ("drop tensor", "extra tensor", "int dtype", "nan"):
        changed = dict(tensors)
        if how == "drop tensor":
            del changed[chosen]
        elif how == "extra tensor":
            changed[
                "b_gate" if at < 0.5 else "threshold" if "threshold" not in changed else "W_skip"
            ] = torch.zeros(3)
        elif how == "int dtype":
            changed[chosen] = changed[chosen].to(torch.int64)
        else:
            changed[chosen] = changed[chosen].clone()
            changed[chosen].view(-1)[int(at * (changed[chosen].numel() - 1))] = math.nan
        _save(folder, cfg, changed)
    elif how == "size":
        key = ("d_in", "d_sae", "d_out")[int(at * 2.99)]
        _save(folder, {**cfg, key: cfg.get(key, 0) + 1 + case["byte"]}, tensors)
    elif how == "no architecture":
        _save(folder, {k: v for k, v in cfg.items() if k != "architecture"}, tensors)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=_folder_cases())
def test_any_folder_loads_as_written_or_is_refused_naming_its_file(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    d, cfg = _original(case)
    folder = _save(tmp_path_factory.mktemp("sae"), cfg, _tensors(d))
    _corrupt(folder, case, cfg, _tensors(d))
    try:
        loaded = load_dictionary(folder)
    except TLError as exc:
        assert str(folder / "cfg.json") in str(exc) or str(
            folder / "sae_weights.safetensors"
        ) in str(exc), exc
        return
    # What loads is the dictionary that was saved (a corruption that changes nothing it reads).
    x = torch.randn(3, d.d_in, generator=torch.Generator().manual_seed(case["seed"]))
    got = loaded.reconstruct(x)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, d.reconstruct(x))


def test_a_transcoders_weights_under_an_autoencoder_config_are_refused(tmp_path: Path) -> None:
    t = random_dictionary(8, 32, d_out=6, apply_b_dec_to_input=False)
    folder = _save(tmp_path / "sae", {"d_in": 8, "d_sae": 32, "metadata": VERSION, "architecture": "standard"},
                   _tensors(t))  # fmt: skip
    with pytest.raises(
        ConfigError,
        match=re.escape(f"{folder / 'cfg.json'}: a 'standard' dictionary writes the width it reads, "
                        "but W_enc is (8, 32) and W_dec (32, 6)"),
    ):  # fmt: skip
        load_dictionary(folder)
