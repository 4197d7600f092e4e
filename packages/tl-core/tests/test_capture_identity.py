"""A store's identity records which model files its rows came from, by content.

A checkpoint whose weights are replaced by others of the same shapes keeps its path, its
sizes and its safetensors headers, so the record hashes the files themselves (weights,
tokenizer and config apart, so a refusal says which changed). These tests need no driver
beyond the native one: the records are read from files, and stores written by "another
model" are made by giving the capture another record. The same refusals on real
checkpoints of the hf driver: ``tests-integration/test_capture_identity.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tl_core import UserError
from tl_core.capture import CaptureConfig, _model_files, _preflight, _run, capture, merge_stores
from tl_core.capture._manifest import MANIFEST, Manifest
from tl_core.capture._model_files import MODEL_KEY, comparable, model_files

HOOKS = ("blocks.0.hook_resid_post",)


def _checkpoint(folder: Path, weights: bytes = b"\x01" * 64, tokenizer: str = "a b c") -> Path:
    """A checkpoint-shaped folder: weights, tokenizer and config files, and a README."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": tokenizer.split()}))
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (folder / "README.md").write_text("a model card")
    return folder


def _job(model: str | Path, source: Path, **changes: Any) -> CaptureConfig:
    fields: dict[str, Any] = {"model": model, "driver": "hf", "hooks": HOOKS, "input": source}
    return CaptureConfig(**{**fields, **changes})


@pytest.fixture
def source(tmp_path: Path, write_documents: Callable[..., Path]) -> Path:
    return write_documents(tmp_path / "docs.txt", n=30)


def test_each_group_of_files_has_its_own_digest(tmp_path: Path, source: Path) -> None:
    folder = _checkpoint(tmp_path / "ckpt")
    first = model_files(_job(folder, source))
    assert first["kind"] == "folder" and first["source"] == str(folder.resolve())
    assert all(isinstance(first[g], str) for g in ("weights", "tokenizer", "config"))
    changed = []
    for name, content in (
        ("README.md", b"another model card"),  # documentation: not part of the model
        ("model.safetensors", b"\x02" * 64),  # other weights of the same size
        ("tokenizer.json", json.dumps({"vocab": ["a", "c", "b"]}).encode()),
        ("config.json", json.dumps({"hidden_size": 8, "rope_theta": 1.0}).encode()),
    ):
        (folder / name).write_bytes(content)
        now = model_files(_job(folder, source))
        changed.append(sorted(g for g in ("weights", "tokenizer", "config") if now[g] != first[g]))
        first = now
    assert changed == [[], ["weights"], ["tokenizer"], ["config"]]
    copy = _checkpoint(tmp_path / "copy", b"\x02" * 64, "a c b")
    (copy / "config.json").write_bytes((folder / "config.json").read_bytes())
    moved = model_files(_job(copy, source))
    assert {k: v for k, v in moved.items() if k != "source"} == {
        k: v for k, v in first.items() if k != "source"
    }, "the digests follow the content, not the path"


def test_a_gguf_file_and_a_tokenizer_option_are_recorded_by_content(
    tmp_path: Path, source: Path
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 60)
    record = model_files(_job(gguf, source))
    assert record == {
        "kind": "gguf",
        "source": str(gguf.resolve()),
        "file": hashlib.sha256(gguf.read_bytes()).hexdigest()[:16],
    }
    folder = _checkpoint(tmp_path / "ckpt")
    tokenizers = _checkpoint(tmp_path / "tok", tokenizer="x y z")
    with_option = model_files(_job(folder, source, boot_options={"tokenizer": str(tokenizers)}))
    own = model_files(_job(tokenizers, source))
    assert with_option["tokenizer_source"] == str(tokenizers.resolve())
    assert (
        with_option["tokenizer"]
        == own["tokenizer"]
        != model_files(_job(folder, source))["tokenizer"]
    )


def test_a_large_file_is_hashed_in_pieces_and_every_piece_counts(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_model_files, "_PIECE", 16)  # pieces of 16 bytes instead of 64 MiB
    gguf = tmp_path / "m.gguf"
    content = bytearray(b"GGUF" + bytes(range(40)))  # 44 bytes: pieces of 16, 16 and 12
    gguf.write_bytes(content)
    pieces = [hashlib.sha256(content[i : i + 16]).hexdigest() for i in range(0, 44, 16)]
    expected = hashlib.sha256("\n".join(pieces).encode()).hexdigest()[:16]
    assert model_files(_job(gguf, source))["file"] == expected
    seen = {expected}
    for at in (0, 20, 43):  # a byte in each piece
        changed = bytearray(content)
        changed[at] ^= 0xFF
        gguf.write_bytes(changed)
        seen.add(model_files(_job(gguf, source))["file"])
    assert len(seen) == 4


def test_relative_paths_are_recorded_as_absolute_ones(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = _checkpoint(tmp_path / "one" / "ckpt"), _checkpoint(tmp_path / "two" / "ckpt")
    (two / "model.safetensors").write_bytes(b"\x02" * 64)
    seen = []
    for folder in (one, two):
        monkeypatch.chdir(folder.parent)
        config = _job("./ckpt", source, boot_options={"tokenizer": "ckpt"})
        assert config.model == str(folder.resolve())
        assert config.boot_options["tokenizer"] == str(folder.resolve())
        seen.append(model_files(config))
    assert seen[0]["source"] != seen[1]["source"] and seen[0]["weights"] != seen[1]["weights"]
    # A native model is a preset name, even where a folder of that name exists.
    (tmp_path / "one" / "gpt2").mkdir()
    monkeypatch.chdir(tmp_path / "one")
    native = CaptureConfig(model="gpt2", driver="native", hooks=HOOKS, input=source)
    assert native.model == "gpt2"
    assert model_files(native) == {"kind": "native", "source": "gpt2"}


def test_a_hub_id_is_recorded_by_the_commit_of_its_local_snapshot(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--tiny"
    first, second = "1" * 40, "2" * 40
    for commit in (first, second):
        (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(first)
    config = _job("org/tiny", source)
    assert config.model == "org/tiny"  # no such local path: a hub id
    record = model_files(config)
    assert record == {"kind": "hub", "source": "org/tiny", "revision": None, "commit": first}
    (repo / "refs" / "main").write_text(second)  # the hub moved main; a boot fetched it
    assert model_files(config)["commit"] == second
    pinned = model_files(_job("org/tiny", source, boot_options={"revision": first}))
    assert (pinned["revision"], pinned["commit"]) == (first, first)
    by_checkpoint = model_files(_job("org/tiny", source, boot_options={"checkpoint_index": 3}))
    assert by_checkpoint["commit"] is None, "main's snapshot is not the checkpoint's"
    missing = model_files(_job("org/other", source))
    assert missing["commit"] is None and not comparable(missing)


def test_after_the_boot_a_hub_id_is_resolved_again_and_an_uncached_one_is_named(
    tmp_path: Path,
    source: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    config = _job("org/tiny", source)
    before = model_files(config)
    assert before["commit"] is None  # not cached yet: the boot downloads it
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "snapshots" / ("3" * 40)).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("3" * 40)
    assert _model_files.refreshed(config, before)["commit"] == "3" * 40
    with caplog.at_level(logging.WARNING, logger="tl_core.capture"):
        other = _job("org/never-cached", source)
        _model_files.refreshed(other, model_files(other))
    assert "'org/never-cached' has no snapshot in the hub cache" in caplog.text
    folder = _checkpoint(tmp_path / "ckpt")
    record = model_files(_job(folder, source))
    (folder / "model.safetensors").write_bytes(b"\x03" * 64)
    assert _model_files.refreshed(_job(folder, source), record) == record, (
        "files are hashed once, before the boot"
    )


# -- stores of other model files, of earlier tl-cores, and nodes that read other files --


def _native(source: Path) -> CaptureConfig:
    return CaptureConfig(
        model="gpt2", driver="native", boot_options={"n_layers": 1, "seed": 0}, hooks=HOOKS,
        input=source, context_size=16, batch_size=2, shard_contexts=2,
    )  # fmt: skip


@pytest.fixture
def recorded_as(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, Any]], None]:
    """``recorded_as(record)``: later captures in this test find ``record`` as their
    model's files (as if the checkpoint on disk were that one)."""

    def use(record: dict[str, Any]) -> None:
        monkeypatch.setattr(_preflight, "model_files", lambda config: dict(record))

    return use


def _older_tl_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Later captures write stores as a tl-core before model records did."""
    original = _run.identity

    def identity(*args: Any) -> dict[str, Any]:
        wanted = original(*args)
        del wanted[MODEL_KEY]
        return wanted

    monkeypatch.setattr(_run, "identity", identity)


def _folder(weights: str) -> dict[str, Any]:
    return {
        "kind": "folder", "source": "/models/ckpt", "weights": weights,
        "tokenizer": "7777777777777777", "config": "8888888888888888",
    }  # fmt: skip


A, B = _folder("aaaaaaaaaaaaaaaa"), _folder("bbbbbbbbbbbbbbbb")


def test_parts_of_other_model_files_are_not_merged(
    source: Path, tmp_path: Path, recorded_as: Callable[[dict[str, Any]], None]
) -> None:
    recorded_as(A)
    capture(_native(source), tmp_path / "p0", part=(0, 2), progress=False)
    recorded_as(B)
    capture(_native(source), tmp_path / "p1", part=(1, 2), progress=False)
    with pytest.raises(UserError, match="hold rows of different models") as error:
        merge_stores([tmp_path / "p0", tmp_path / "p1"], tmp_path / "merged")
    message = str(error.value)
    assert (
        f"{tmp_path / 'p0'} was captured from '/models/ckpt' (weights sha256 {A['weights']}"
        in message
    )
    assert f"{tmp_path / 'p1'} from '/models/ckpt' (weights sha256 {B['weights']}" in message
    assert "; they differ in the weights." in message and "recapture every part" in message
    assert not (tmp_path / "merged").exists()


def test_a_resume_with_other_model_files_is_refused_before_the_boot(
    source: Path,
    tmp_path: Path,
    recorded_as: Callable[[dict[str, Any]], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorded_as(A)
    capture(_native(source), tmp_path / "store", part=(0, 2), progress=False)
    manifest = (tmp_path / "store" / MANIFEST).read_bytes()
    recorded_as(B)
    booted: list[str] = []
    monkeypatch.setattr("tl_core.bridges._boot.boot", lambda *a, **k: booted.append("boot"))
    with pytest.raises(UserError, match=r"holds rows of another model") as error:
        capture(_native(source), tmp_path / "store", part=(0, 2), progress=False)
    assert f"weights sha256 {A['weights']}" in str(error.value)
    assert f"weights sha256 {B['weights']}" in str(error.value)
    assert "they differ in the weights" in str(error.value)
    assert booted == [] and (tmp_path / "store" / MANIFEST).read_bytes() == manifest


def test_stores_of_an_earlier_tl_core_are_not_continued_and_merge_with_a_warning(
    source: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with monkeypatch.context() as patched:
        _older_tl_core(patched)
        for part in (0, 1):
            capture(_native(source), tmp_path / f"old{part}", part=(part, 2), progress=False)
    assert MODEL_KEY not in Manifest.load(tmp_path / "old0").identity
    with pytest.raises(UserError, match=r"earlier tl-core.*no digest of its weights and tokenizer"):
        capture(_native(source), tmp_path / "old0", part=(0, 2), progress=False)
    with caplog.at_level(logging.WARNING, logger="tl_core.capture"):
        merge_stores([tmp_path / "old0", tmp_path / "old1"], tmp_path / "merged")
    assert "cannot check that every part holds rows of the same model" in caplog.text
    capture(_native(source), tmp_path / "new1", part=(1, 2), progress=False)
    with pytest.raises(UserError, match=r"old0 was written by an earlier tl-core.*recapture"):
        merge_stores([tmp_path / "old0", tmp_path / "new1"], tmp_path / "mixed")


def test_a_node_that_reads_other_model_files_is_refused_before_it_boots(
    source: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError) as error:
        _run.capture_attempt(
            _native(source), tmp_path / "part", part=(0, 1), repair=False, progress=False,
            bridge=None, job="test", expected_model=A,
        )  # fmt: skip
    message = str(error.value)
    assert message.startswith(f"{socket.gethostname()} reads native preset 'gpt2'")
    assert f"submitted with '/models/ckpt' (weights sha256 {A['weights']}" in message
    assert "same checkpoint at the same path" in message
    assert not (tmp_path / "part").exists()
