"""A capture store never holds rows of two models (issue #47, item 1), on real checkpoints.

Each case replaces a tiny hf checkpoint's weights (or tokenizer) between two runs that join
their rows: two parts merged, a resume after SIGKILL, a relative ``--model`` path used from
two working folders, a Ray job's parts. The replacement has the same shapes, so the
checkpoint's path, sizes and safetensors header stay as they were; the store must still
refuse to join the rows, naming both models. The property suite draws the swaps, the
joins and the ways of naming the path, and checks both directions: every swap is refused,
and every run without one is accepted and reads back the rows of a run that was never
interrupted or split.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from tl_core import UserError
from tl_core.capture import CaptureConfig, CaptureStore, _run, capture, capture_on_ray, merge_stores
from tl_core.capture._manifest import MANIFEST, Manifest
from tl_core.capture._on_ray import part_folders
from tl_core.cli import main

write_tiny_checkpoint = pytest.importorskip("tl_driver_hf.testing").write_tiny_checkpoint

HOOKS = ("blocks.0.hook_resid_post", "blocks.1.mlp.hook_out")
ROW_FIELDS = ("tokens", "documents", "contexts", "positions")
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "over",
    "hills",
    "and",
    "birds",
    "sang",
    "in",
    "old",
    "trees",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny Llama checkpoints of the same shapes and tokenizer, other weights."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "a": write_tiny_checkpoint("llama", root / "a", seed=0),
        "b": write_tiny_checkpoint("llama", root / "b", seed=1),
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 9)) for i in range(24)]
    path = tmp_path_factory.mktemp("input") / "docs.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _job(model: str | Path, source: Path) -> CaptureConfig:
    return CaptureConfig(
        model=str(model), driver="hf", boot_options={"dtype": "float32"}, hooks=HOOKS,
        input=source, context_size=16, batch_size=2, shard_contexts=2,
    )  # fmt: skip


def _cli(model: str | Path, source: Path, output: Path, *extra: str) -> list[str]:
    return [
        "capture", "run", "--model", str(model), "--option", "dtype=float32",
        "--hooks", *HOOKS, "--input", str(source), "--output", str(output),
        "--context-size", "16", "--batch-size", "2", "--shard-contexts", "2", "--quiet", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(
    checkpoints: dict[str, Path], source: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, torch.Tensor]:
    """Every hook and row field of one uninterrupted run on checkpoint ``a``."""
    out = tmp_path_factory.mktemp("reference") / "store"
    capture(_job(checkpoints["a"], source), out, progress=False)
    return _rows(out)


def _rows(store: Path) -> dict[str, torch.Tensor]:
    opened = CaptureStore(store)
    return {name: opened.read(name) for name in (*HOOKS, *ROW_FIELDS)}


def _same_rows(store: Path, reference: dict[str, torch.Tensor]) -> None:
    got = _rows(store)
    for name, want in reference.items():
        assert torch.equal(got[name], want), name


def _swap_weights(folder: Path, donor: Path) -> None:
    """Replace ``folder``'s weights by ``donor``'s: same shapes, same header, same size."""
    mine, theirs = folder / "model.safetensors", donor / "model.safetensors"
    header = int.from_bytes(mine.read_bytes()[:8], "little")
    assert mine.read_bytes()[: 8 + header] == theirs.read_bytes()[: 8 + header]
    assert mine.stat().st_size == theirs.stat().st_size
    shutil.copyfile(theirs, mine)


def _swap_tokenizer(folder: Path) -> None:
    """Exchange the ids of two letters: the same vocabulary size, another tokenization."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["e"] = vocab["e"], vocab["a"]
    path.write_text(json.dumps(data))


def _model_record(store: Path) -> dict[str, Any]:
    record: dict[str, Any] = Manifest.load(store).identity["model_files"]
    return record


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``tl`` expecting one ``tl: error:`` line; returns it."""
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tl: error: ") and "Traceback" not in err, err
    return err


def test_two_parts_of_swapped_weights_are_not_merged(
    checkpoints: dict[str, Path], source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = shutil.copytree(checkpoints["a"], tmp_path / "ckpt")
    assert main(_cli(model, source, tmp_path / "p0", "--shard", "0/2")) == 0
    _swap_weights(model, checkpoints["b"])
    assert main(_cli(model, source, tmp_path / "p1", "--shard", "1/2")) == 0
    capsys.readouterr()
    err = _refused(
        [
            "capture",
            "merge",
            str(tmp_path / "p0"),
            str(tmp_path / "p1"),
            "--output",
            str(tmp_path / "m"),
        ],
        capsys,
    )
    first, second = _model_record(tmp_path / "p0"), _model_record(tmp_path / "p1")
    assert first["weights"] != second["weights"] and first["tokenizer"] == second["tokenizer"]
    assert (
        f"weights sha256 {first['weights']}" in err and f"weights sha256 {second['weights']}" in err
    )
    assert "they differ in the weights." in err and "recapture" in err
    assert not (tmp_path / "m").exists()


def test_two_parts_of_swapped_tokenizers_are_not_merged(
    checkpoints: dict[str, Path], source: Path, tmp_path: Path
) -> None:
    model = shutil.copytree(checkpoints["a"], tmp_path / "ckpt")
    capture(_job(model, source), tmp_path / "p0", part=(0, 2), progress=False)
    _swap_tokenizer(model)
    capture(_job(model, source), tmp_path / "p1", part=(1, 2), progress=False)
    with pytest.raises(UserError, match=r"different models.*they differ in the tokenizer\."):
        merge_stores([tmp_path / "p0", tmp_path / "p1"], tmp_path / "m")


#: ``tl capture run`` that SIGKILLs itself halfway through writing shard KILL_AT.
KILLER = """
import os, signal, sys
from tl_core.capture import _run, _shards
at, original = int(os.environ["KILL_AT"]), _shards.write_shard

def write_shard(folder, index, tensors, metadata, summary):
    if index == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(folder, index, tensors, metadata, summary)

_run.write_shard = write_shard
from tl_core.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_resume_after_sigkill_with_swapped_weights_is_refused(
    checkpoints: dict[str, Path],
    source: Path,
    reference: dict[str, torch.Tensor],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = shutil.copytree(checkpoints["a"], tmp_path / "ckpt")
    out = tmp_path / "store"
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, *_cli(model, source, out)],
        env={**os.environ, "KILL_AT": "2"},
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert sorted(Manifest.load(out).shards) == [0, 1]
    manifest = (out / MANIFEST).read_bytes()
    _swap_weights(model, checkpoints["b"])
    err = _refused(_cli(model, source, out), capsys)
    assert "holds rows of another model" in err and "they differ in the weights." in err
    assert (out / MANIFEST).read_bytes() == manifest, "nothing was written"
    _swap_weights(model, checkpoints["a"])  # the store's own checkpoint: the resume goes on
    assert main(_cli(model, source, out)) == 0
    _same_rows(out, reference)


def test_a_relative_model_path_from_two_folders_is_two_models(
    checkpoints: dict[str, Path],
    source: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    one = shutil.copytree(checkpoints["a"], tmp_path / "one" / "ckpt")
    two = shutil.copytree(checkpoints["b"], tmp_path / "two" / "ckpt")
    monkeypatch.chdir(one.parent)
    assert main(_cli("./ckpt", source, tmp_path / "p0", "--shard", "0/2")) == 0
    monkeypatch.chdir(two.parent)
    assert main(_cli("./ckpt", source, tmp_path / "p1", "--shard", "1/2")) == 0
    assert Manifest.load(tmp_path / "p1").identity["config"]["model"] == str(two.resolve())
    capsys.readouterr()
    err = _refused(
        [
            "capture",
            "merge",
            str(tmp_path / "p0"),
            str(tmp_path / "p1"),
            "--output",
            str(tmp_path / "m"),
        ],
        capsys,
    )
    assert repr(str(one.resolve())) in err and repr(str(two.resolve())) in err
    assert "they differ in the path and the weights." in err


def test_a_ray_job_refuses_a_part_folder_of_other_weights_before_the_cluster(
    checkpoints: dict[str, Path], source: Path, tmp_path: Path
) -> None:
    model = shutil.copytree(checkpoints["a"], tmp_path / "ckpt")
    out = tmp_path / "store"
    capture(_job(model, source), part_folders(out, 2)[0], part=(0, 2), progress=False)
    _swap_weights(model, checkpoints["b"])
    with pytest.raises(UserError, match=r"part-0-of-2 holds rows of another model"):
        # No cluster listens there: the refusal comes first.
        capture_on_ray(_job(model, source), out, parts=2, address="127.0.0.1:1", progress=False)


# -- the property suite ------------------------------------------------------------------


def _interrupted(config: CaptureConfig, out: Path, after: int) -> None:
    """A run of ``config`` stopped (as by Ctrl-C) once ``after`` batches ran."""
    calls = {"n": 0}
    original = _run._fill_batch

    def fill(*args: Any) -> int:
        calls["n"] += 1
        if calls["n"] > after:
            raise KeyboardInterrupt
        return original(*args)

    with mock.patch.object(_run, "_fill_batch", fill), contextlib.suppress(KeyboardInterrupt):
        capture(config, out, progress=False)
    assert not Manifest.load(out).complete


@contextlib.contextmanager
def _named(where: str, model: Path, root: Path) -> Iterator[str]:
    """The model as the second run names it (changing the working folder while it runs)."""
    if where == "absolute":
        yield str(model)
    elif where == "relative":
        with contextlib.chdir(model.parent):
            yield "./ckpt"
    elif where == "relative-elsewhere":
        (root / "elsewhere").mkdir()
        with contextlib.chdir(root / "elsewhere"):
            yield "../models/ckpt"
    else:  # an identical copy in another folder: another path, so another model
        yield str(shutil.copytree(model, root / "copy" / "ckpt"))


@settings(
    max_examples=14,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    join=st.sampled_from(["merge", "resume"]),
    weights=st.booleans(),
    tokenizer=st.booleans(),
    where=st.sampled_from(["absolute", "relative", "relative-elsewhere", "copy"]),
)
# Each join with no swap and a path named another way, and with each swap alone.
@example(join="merge", weights=False, tokenizer=False, where="relative-elsewhere")
@example(join="resume", weights=False, tokenizer=False, where="relative")
@example(join="resume", weights=True, tokenizer=False, where="absolute")
@example(join="merge", weights=False, tokenizer=True, where="absolute")
def test_any_swap_is_refused_and_no_swap_is_accepted(
    checkpoints: dict[str, Path],
    source: Path,
    reference: dict[str, torch.Tensor],
    tmp_path_factory: pytest.TempPathFactory,
    join: str,
    weights: bool,
    tokenizer: bool,
    where: str,
) -> None:
    root = tmp_path_factory.mktemp("example")
    model = shutil.copytree(checkpoints["a"], root / "models" / "ckpt")
    first = root / ("p0" if join == "merge" else "store")
    if join == "merge":
        capture(_job(model, source), first, part=(0, 2), progress=False)
    else:
        _interrupted(_job(model, source), first, after=3)
    if weights:
        _swap_weights(model, checkpoints["b"])
    if tokenizer:
        _swap_tokenizer(model)
    accepted = not weights and not tokenizer and where != "copy"
    with _named(where, model, root) as name:
        config = _job(name, source)
        try:
            if join == "merge":
                capture(config, root / "p1", part=(1, 2), progress=False)
                merge_stores([first, root / "p1"], root / "merged")
            else:
                capture(config, first, progress=False)
        except UserError as error:
            assert not accepted, f"refused without a swap: {error}"
            expected = [
                text
                for text, changed in (
                    ("the path", where == "copy"),
                    ("the weights", weights),
                    ("the tokenizer", tokenizer),
                )
                if changed
            ]
            assert all(text in str(error) for text in expected), str(error)
            return
    assert accepted, f"a swap was accepted: weights={weights} tokenizer={tokenizer} where={where}"
    _same_rows(root / "merged" if join == "merge" else first, reference)
