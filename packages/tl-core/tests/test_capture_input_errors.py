"""``tl capture run`` refuses a bad job before the model boots, writes nothing before its
first shard, reports a full disk and a stale lock clearly, and the corrected rerun works.

Input and spec errors run with the boot replaced by a function that fails the test, so
"before the model boots" is checked, not assumed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tl_core import SpecError, UserError
from tl_core.capture import CaptureConfig, CaptureStore, _preflight, _run, _shards, _source, capture
from tl_core.capture._lock import process_start
from tl_core.capture._manifest import MANIFEST, Manifest
from tl_core.cli import main

ARGS = ["--model", "gpt2", "--driver", "native", "--option", "n_layers=2", "--option", "seed=3",
        "--hooks", "resid_post.0", "--context-size", "24", "--batch-size", "3", "--shard-contexts", "3", "--quiet"]  # fmt: skip
MODEL = {"model": "gpt2", "driver": "native", "boot_options": {"n_layers": 2, "seed": 3}}


def config(source: Path, **changes: Any) -> CaptureConfig:
    fields: dict[str, Any] = {
        **MODEL, "hooks": ("blocks.0.hook_resid_post",), "input": str(source),
        "context_size": 24, "batch_size": 3, "shard_contexts": 3,
    }  # fmt: skip
    return CaptureConfig(**{**fields, **changes})


@pytest.fixture
def source(tmp_path: Path, write_documents: Callable[..., Path]) -> Path:
    return write_documents(tmp_path / "docs.txt")


def _booted(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the model was booted")


@contextlib.contextmanager
def no_boot(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if anything boots a model meanwhile."""
    with monkeypatch.context() as patch:
        patch.setattr("tl_core.bridges._boot.boot", _booted)
        yield


def cli(source: Path, out: Path, *extra: str) -> list[str]:
    return ["capture", "run", *ARGS, "--input", str(source), "--output", str(out), *extra]


def refused(
    command: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> str:
    """Run the CLI with booting forbidden; it must fail, leaving no output folder. Returns stderr."""
    capsys.readouterr()
    with no_boot(monkeypatch):
        assert main(command) == 1
    error = capsys.readouterr().err
    assert error.startswith("tl: error: ")
    out = Path(command[command.index("--output") + 1])
    assert not out.exists(), "a refused run left its output folder behind"
    return error


def completes(command: list[str]) -> CaptureStore:
    assert main(command) == 0
    return CaptureStore(command[command.index("--output") + 1])


# -- input ----------------------------------------------------------------------------


def test_empty_binary_and_non_utf8_inputs_are_refused_before_the_boot(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "store"
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    error = refused(cli(empty, out), capsys, monkeypatch)
    assert f"input {empty} is empty (0 bytes)" in error and "one document per line" in error
    binary = tmp_path / "docs.txt.gz"
    binary.write_bytes(b"the cat\nsat\x1f\x8b\x08\x00\x00binary")
    error = refused(cli(binary, out), capsys, monkeypatch)
    assert f"input {binary} is not text: byte 14 (line 2) is a NUL byte" in error
    assert "Decompress" in error
    latin = tmp_path / "latin.txt"
    latin.write_bytes("the cat\nsat on\nthe café mat\n".encode("latin-1"))
    error = refused(cli(latin, out), capsys, monkeypatch)
    assert f"input {latin}, line 3 (byte 22): not UTF-8 (invalid continuation byte)" in error
    assert "iconv -f latin1 -t utf-8" in error
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\r\n\n")
    error = refused(cli(blank, out), capsys, monkeypatch)
    assert "holds no document to capture: its 3 lines are all empty" in error
    # The corrected rerun, into the same output folder.
    latin.write_text("the cat\nsat on\nthe café mat\n" * 20)
    assert len(completes(cli(latin, out))) > 0


def test_a_multibyte_character_split_across_read_chunks_is_utf8(tmp_path: Path) -> None:
    text = tmp_path / "long.txt"
    text.write_bytes(
        b"a" * ((1 << 22) - 1) + "é\n".encode()
    )  # é's two bytes straddle the 4 MiB read
    assert _source.open_source(text, None, "text").digest().startswith("sha256:")
    text.write_bytes(b"a" * ((1 << 22) - 1) + b"\xc3\n")  # a lone lead byte at the boundary
    with pytest.raises(UserError, match=r"line 1 \(byte 4,194,303\): not UTF-8"):
        _source.open_source(text, None, "text").digest()


def test_jsonl_records_without_the_text_field_are_refused_before_the_boot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    records = tmp_path / "docs.jsonl"
    records.write_text(
        "".join(json.dumps({"body": f"document {i} " * 4, "id": i}) + "\n" for i in range(30))
    )
    out = tmp_path / "store"
    error = refused(cli(records, out), capsys, monkeypatch)
    assert (
        f"input {records}, line 1: the record has no field 'text' (found ['body', 'id'])" in error
    )
    assert "--text-field" in error
    # Past the records parsed in full, a line without the field's name is still caught.
    monkeypatch.setattr(_source, "CHECKED_RECORDS", 3)
    lines = [json.dumps({"text": f"document {i} " * 4}) for i in range(30)]
    lines[20] = json.dumps({"txt": "a typo"})
    records.write_text("\n".join(lines) + "\n")
    error = refused(cli(records, out), capsys, monkeypatch)
    assert f"input {records}, line 21: the record has no field 'text' (found ['txt'])" in error
    lines[20] = "not json"
    records.write_text("\n".join(lines) + "\n")
    error = refused(cli(records, out), capsys, monkeypatch)
    assert f"input {records}, line 21: not JSON (Expecting value at column 1)" in error
    lines[20] = json.dumps({"text": "fixed"})
    records.write_text("\n".join(lines) + "\n")
    assert len(completes(cli(records, out))) > 0


def test_a_late_record_that_fails_mid_run_names_its_line_and_what_became_of_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_source, "CHECKED_RECORDS", 3)
    lines = [json.dumps({"text": f"document number {i} " * 3}) for i in range(40)]
    lines[30] = json.dumps({"meta": {"text": "nested"}})  # holds the name, not the field
    records = tmp_path / "docs.jsonl"
    records.write_text("\n".join(lines) + "\n")
    out = tmp_path / "store"
    assert main(cli(records, out)) == 1
    error = capsys.readouterr().err
    assert f"input {records}, line 31: the record has no field 'text' (found ['meta'])" in error
    kept = len(Manifest.load(out).shards)
    assert kept > 0 and f"{out} keeps the {kept} shard(s) cut before that line" in error
    assert "rerun with a new output folder, or delete" in error
    lines[30] = json.dumps({"text": "fixed"})
    records.write_text("\n".join(lines) + "\n")
    assert main(cli(records, out)) == 1  # another input: the old store refuses it, by name
    assert "input_digest" in capsys.readouterr().err
    assert completes(cli(records, tmp_path / "new")).manifest.complete
    # Failing before the first shard writes nothing at all.
    monkeypatch.setattr(_source, "CHECKED_RECORDS", 1)
    lines[1] = json.dumps({"meta": {"text": "nested"}})
    records.write_text("\n".join(lines) + "\n")
    assert main(cli(records, tmp_path / "early")) == 1
    assert "Nothing was written to" in capsys.readouterr().err
    assert not (tmp_path / "early").exists()


# -- intervention specs ---------------------------------------------------------------


def test_bad_intervene_specs_are_refused_before_the_boot(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out, specs = tmp_path / "store", tmp_path / "specs.json"
    command = cli(source, out, "--intervene", str(specs))
    error = refused(command, capsys, monkeypatch)
    assert f"--intervene {specs}: no such file" in error
    specs.write_text('{"blocks.0.hook_resid_post": {"op": "add", "value": 1.0,}}')
    error = refused(command, capsys, monkeypatch)
    assert f"--intervene {specs}, line 1 column 57: not JSON" in error
    specs.write_text(json.dumps({"blocks.0.hook_resid_post": {"op": "ad", "value": 1.0}}))
    error = refused(command, capsys, monkeypatch)
    assert (
        f"--intervene {specs}: intervention on 'blocks.0.hook_resid_post': key 'op' is 'ad'"
        in error
    )
    assert "did you mean 'add'?" in error
    specs.write_text(json.dumps([{"blocks.0.hook_resid_post": {"op": "suppress"}}]))
    error = refused(command, capsys, monkeypatch)
    assert "applies one mapping of hook name to specs to every context, found a list" in error
    # The API checks the same before its boot.
    with pytest.raises(SpecError, match="key 'factor'"):
        capture(config(source, intervene={"resid_post.0": {"op": "scale"}}), out, progress=False)
    assert not out.exists()
    specs.write_text(json.dumps({"blocks.0.hook_resid_post": {"op": "add", "value": 1.0}}))
    assert completes(command).manifest.complete


def test_specs_the_booted_model_cannot_apply_are_refused_before_anything_is_written(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, specs = tmp_path / "store", tmp_path / "specs.json"
    command = cli(source, out, "--intervene", str(specs))
    specs.write_text(json.dumps({"blocks.0.hook_resid_post": {"op": "add", "value": [1.0, 2.0]}}))
    assert main(command) == 1
    error = capsys.readouterr().err
    assert "key 'value' has width 2, expected 64" in error and "; nothing was written" in error
    specs.write_text(json.dumps({"blocks.7.hook_resid_post": {"op": "suppress"}}))
    assert main(command) == 1
    assert "blocks.7" in capsys.readouterr().err
    assert not out.exists()
    specs.write_text(json.dumps({"blocks.0.hook_resid_post": {"op": "add", "value": [1.0] * 64}}))
    assert completes(command).manifest.complete


# -- context size ---------------------------------------------------------------------


def test_a_context_longer_than_the_model_takes_is_refused_before_the_boot(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "store"
    error = refused(cli(source, out, "--option", "n_ctx=16"), capsys, monkeypatch)
    assert (
        "context_size (--context-size) 24 is longer than model 'gpt2' takes on driver 'native': 16 tokens"
        in error
    )
    assert "checked before the model boots" in error and "Pass --context-size 16 or less" in error
    # A folder of an hf-style checkpoint: its config.json says how long.
    folder = tmp_path / "tiny-gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 8, "n_head": 2,
         "vocab_size": 300, "n_positions": 20}
    ))  # fmt: skip
    hf = [*cli(source, out), "--model", str(folder), "--driver", "hf"]
    error = refused(hf, capsys, monkeypatch)
    assert (
        f"on driver 'hf': 20 tokens ({folder / 'config.json'}; checked before the model boots)"
        in error
    )
    assert "--option n_ctx=N" in error
    error = refused([*hf[:-1], "vllm", "--option", "max_model_len=12"], capsys, monkeypatch)
    assert "11 tokens (the boot option max_model_len=12, less the token vLLM samples" in error
    assert len(completes(cli(source, out, "--option", "n_ctx=24"))) > 0


def test_a_context_longer_than_the_booted_model_takes_is_refused_before_anything_is_written(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A driver whose config cannot be read before the boot: the booted model's n_ctx decides.
    monkeypatch.setattr(_preflight, "context_limit_before_boot", lambda config: None)
    out = tmp_path / "store"
    assert main(cli(source, out, "--option", "n_ctx=16")) == 1
    error = capsys.readouterr().err
    assert (
        "16 tokens (the booted model's n_ctx; checked after the boot; nothing was written)" in error
    )
    assert not out.exists()
    assert len(completes(cli(source, out, "--context-size", "16", "--option", "n_ctx=16"))) > 0


# -- nothing written before the first shard -------------------------------------------


def test_a_manifest_without_shards_gives_way_to_a_new_configuration(
    source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "store"
    capture(config(source, max_tokens=30), out, progress=False)
    # What an older tl-core left when its run failed before the first shard.
    data = json.loads((out / MANIFEST).read_text())
    data.update(shards=[], total_shards=None, rows=0, tokens=0, complete=False)
    (out / MANIFEST).write_text(json.dumps(data))
    for shard in out.glob("shard-*"):
        shard.unlink()
    with caplog.at_level(logging.WARNING, logger="tl_core.capture"):
        summary = capture(config(source, max_tokens=30, context_size=16), out, progress=False)
    assert summary.complete
    note = "held the manifest of a capture that wrote no shard, with another configuration (config.context_size: 24 -> 16"
    assert any(note in n for n in summary.notes)
    assert note in caplog.text
    # A store with shards still refuses another configuration, before the model boots.
    with pytest.raises(UserError, match=r"config\.context_size: 16 -> 24"):
        capture(config(source, max_tokens=30), out, progress=False)


def test_another_configuration_is_refused_before_the_boot(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "store"
    assert main(cli(source, out, "--max-tokens", "60")) == 0
    capsys.readouterr()
    with no_boot(monkeypatch):
        assert main(cli(source, out, "--max-tokens", "60", "--context-size", "16")) == 1
        assert main(cli(source, out, "--max-tokens", "60", "--shard", "1/2")) == 1
    error = capsys.readouterr().err
    assert (
        "config.context_size: 24 -> 16" in error
        and "holds part 0/1 of the job; this run is part 1/2" in error
    )


# -- a full disk ----------------------------------------------------------------------


def _fail_shard(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """Make the shard writer find the disk full at shard ``at``."""

    def write_shard(folder: Path, index: int, *args: Any) -> Any:
        if index == at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return _shards.write_shard(folder, index, *args)

    monkeypatch.setattr(_run, "write_shard", write_shard)


def test_a_full_disk_is_reported_and_the_same_command_continues(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = completes(cli(source, tmp_path / "reference"))
    out = tmp_path / "store"
    with monkeypatch.context() as patch:
        _fail_shard(patch, 2)
        assert main(cli(source, out)) == 1
    error = capsys.readouterr().err
    assert (
        f"the disk holding {out} is full (No space left on device) while writing shard 2 "
        f"(shard-000002.safetensors); 2 shard(s) are complete and recorded in {out / MANIFEST}"
    ) in error
    assert "rerun the same command: it keeps every recorded shard" in error
    assert "continues after the last complete shard" in error
    assert sorted(Manifest.load(out).shards) == [0, 1]
    assert main(cli(source, out)) == 0
    assert "2 already there" in capsys.readouterr().out
    _same_shards(out, reference)


def test_a_full_disk_at_the_first_shard_leaves_no_store(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "store"
    with monkeypatch.context() as patch:
        _fail_shard(patch, 0)
        assert main(cli(source, out)) == 1
    assert "no shard is recorded yet" in capsys.readouterr().err
    assert not out.exists()
    assert completes(cli(source, out)).manifest.complete


def test_a_full_disk_while_recording_a_shard_redoes_it(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = completes(cli(source, tmp_path / "reference"))
    out = tmp_path / "store"
    original = Manifest.save

    def save(self: Manifest, folder: Path) -> None:
        if len(self.shards) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(self, folder)

    with monkeypatch.context() as patch:
        patch.setattr(Manifest, "save", save)
        assert main(cli(source, out)) == 1
    error = capsys.readouterr().err
    assert (
        "while recording shard 1 in the manifest (the shard is redone on the rerun); 1 shard(s)"
        in error
    )
    assert (out / "shard-000001.safetensors").exists() and sorted(Manifest.load(out).shards) == [0]
    assert main(cli(source, out)) == 0
    assert "shard-000001.safetensors was written but not recorded" in capsys.readouterr().out
    _same_shards(out, reference)


def _same_shards(got: Path, reference: CaptureStore) -> None:
    manifest = Manifest.load(got)
    assert manifest.complete
    assert {i: s.sha256 for i, s in manifest.shards.items()} == {
        i: s.sha256 for i, s in reference.manifest.shards.items()
    }


def test_leftovers_of_a_first_shard_are_cleared_and_more_shards_without_a_manifest_refused(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "store"
    out.mkdir()
    (out / "shard-000000.safetensors").write_bytes(b"half")  # killed between rename and manifest
    (out / ".shard-000001.safetensors.partial").write_bytes(b"half")
    summary = capture(config(source, max_tokens=30), out, progress=False)
    assert summary.complete and not (out / ".shard-000001.safetensors.partial").exists()
    assert any("shard-000000.safetensors was written but not recorded" in n for n in summary.notes)
    lost = tmp_path / "lost"
    lost.mkdir()
    for name in ("shard-000000.safetensors", "shard-000001.safetensors"):
        (lost / name).write_bytes(b"data")
    with no_boot(monkeypatch):
        assert main(cli(source, lost)) == 1
    error = capsys.readouterr().err
    assert (
        f"{lost} holds 2 shard files but no manifest.json" in error
        and f"restore {lost / MANIFEST}" in error
    )


# -- the lock -------------------------------------------------------------------------


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is no capture."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_lock_whose_process_id_was_reused_is_taken_over(
    source: Path, tmp_path: Path, stranger: subprocess.Popen[bytes]
) -> None:
    out = tmp_path / "store"
    out.mkdir()
    lock = {
        "pid": stranger.pid,
        "host": socket.gethostname(),
        "started": "another-boot:1",
        "command": "tl capture run",
    }
    (out / ".lock").write_text(json.dumps(lock))
    summary = capture(config(source, max_tokens=30), out, progress=False)
    assert summary.complete and not (out / ".lock").exists()
    assert any(
        f"took over {out / '.lock'}" in n
        and f"its process {stranger.pid} has exited; that id now belongs to another process" in n
        for n in summary.notes
    )


def test_a_live_capture_holds_the_lock_and_an_unprovable_one_names_the_file_to_delete(
    source: Path, tmp_path: Path, stranger: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "store"
    out.mkdir()
    lock = out / ".lock"
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": process_start(os.getpid()),
        "command": "tl capture run",
    }
    lock.write_text(json.dumps(me))
    with no_boot(monkeypatch):
        with pytest.raises(
            UserError,
            match=rf"another capture \(process {os.getpid()} .*\) is writing {re.escape(str(out))}; wait",
        ):
            capture(config(source, max_tokens=30), out, progress=False)
        # tl-core 0.1's lock records no start time: a live process with its id may be unrelated.
        lock.write_text(f"{stranger.pid} {socket.gethostname()}")
        with pytest.raises(UserError) as error:
            capture(config(source, max_tokens=30), out, progress=False)
    message = str(error.value)
    assert f"names a process that is still running (process {stranger.pid} (" in message
    assert "another capture" not in message and f"delete {lock} and rerun" in message
    lock.unlink()
    assert capture(config(source, max_tokens=30), out, progress=False).complete


def test_the_model_argument_picks_the_driver_as_tl_hooks_does(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No --driver: a native preset boots native, a missing path is refused before any boot."""
    out = tmp_path / "store"
    plain = [a for a in cli(source, out) if a not in ("--driver", "native")]
    store = completes(plain)
    assert store.manifest.identity["config"]["driver"] == "native"
    missing = [
        *plain[: plain.index("--model") + 1],
        "./no-such-folder",
        *plain[plain.index("--model") + 2 :],
    ]
    missing[missing.index("--output") + 1] = str(tmp_path / "other")
    error = refused(missing, capsys, monkeypatch)
    assert "--model='./no-such-folder' is a path, but folder" in error


def test_a_model_folder_given_as_a_path_is_recorded_as_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = CaptureConfig(
        model=Path("model"), hooks=("blocks.0.hook_resid_post",), input="corpus.txt"
    )  # type: ignore[arg-type]
    assert config.model == str(tmp_path / "model")
    assert json.loads(json.dumps(config.to_json()))["model"] == str(tmp_path / "model")
    # A string stays as written: it may be a hub id or a native preset.
    assert (
        CaptureConfig(model="org/name", hooks=("blocks.0.hook_resid_post",), input="x").model
        == "org/name"
    )
