"""A capture survives being killed, splits into parts that merge back, and refuses damage.

Kills are real: ``tl capture run`` runs in a subprocess that is sent SIGKILL, from outside
while it works, or by itself at a chosen point of a shard write (half a file on disk, or a
whole file not yet recorded). Every resumed or merged store must equal an uninterrupted
run's, byte for byte in its shards and token for token through the reader.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tl_core import UserError
from tl_core.capture import CaptureConfig, CaptureStore, capture, merge_stores
from tl_core.capture._manifest import MANIFEST, Manifest

HOOKS = ("blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.mlp.hook_post")
ARGS = ["--model", "gpt2", "--driver", "native", "--option", "n_layers=2", "--option", "seed=3",
        "--context-size", "24", "--batch-size", "2", "--shard-contexts", "4", "--quiet"]  # fmt: skip

# Runs `tl capture run` with SIGKILL arranged at shard KILL_AT: "half" leaves half the
# shard's bytes in its partial file, "unrecorded" leaves the whole file renamed into place
# but not in the manifest, "slow" sleeps per batch so the test can kill from outside.
KILLER = """
import os, signal, sys, time
from tl_core.capture import _run, _shards
mode, at = os.environ["KILL_MODE"], int(os.environ.get("KILL_AT", "-1"))
original_write, original_batch = _shards.write_shard, _run._fill_batch

def write_shard(folder, index, tensors, metadata, summary):
    if mode == "half" and index == at:
        from safetensors.torch import save
        data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
        partial = folder / f".{_shards.shard_name(index)}.partial"
        partial.write_bytes(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    record = original_write(folder, index, tensors, metadata, summary)
    if mode == "unrecorded" and index == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return record

def fill_batch(*args):
    if mode == "slow":
        time.sleep(0.05)
    return original_batch(*args)

_run.write_shard, _run._fill_batch = write_shard, fill_batch
from tl_core.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, write_documents: Callable[..., Path]) -> Path:
    return write_documents(tmp_path_factory.mktemp("input") / "docs.txt", n=60)


@pytest.fixture(scope="module")
def reference(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of the job."""
    out = tmp_path_factory.mktemp("reference") / "store"
    _cli(source, out)
    return out


def _command(source: Path, out: Path, *extra: str) -> list[str]:
    return [
        "capture",
        "run",
        *ARGS,
        "--hooks",
        *HOOKS,
        "--input",
        str(source),
        "--output",
        str(out),
        *extra,
    ]


def _cli(source: Path, out: Path, *extra: str) -> None:
    from tl_core.cli import main

    assert main(_command(source, out, *extra)) == 0


def _spawn(source: Path, out: Path, mode: str, at: int = -1) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KILL_MODE": mode, "KILL_AT": str(at)}
    return subprocess.Popen(
        [sys.executable, "-c", KILLER, *_command(source, out)], env=env, stderr=subprocess.PIPE
    )


def _same_store(got: Path, want: Path) -> None:
    a, b = Manifest.load(got), Manifest.load(want)
    assert a.complete and b.complete
    assert {i: s.sha256 for i, s in a.shards.items()} == {i: s.sha256 for i, s in b.shards.items()}
    left, right = CaptureStore(got), CaptureStore(want)
    for name in (*HOOKS, "tokens", "documents", "contexts", "positions"):
        assert torch.equal(left.read(name), right.read(name)), name


@pytest.mark.parametrize("mode", ["half", "unrecorded"])
def test_a_kill_inside_a_shard_write_is_detected_and_redone(
    mode: str, source: Path, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "store"
    process = _spawn(source, out, mode, at=3)
    process.wait(timeout=120)
    assert process.returncode == -signal.SIGKILL
    killed = Manifest.load(out)
    assert sorted(killed.shards) == [0, 1, 2] and not killed.complete
    left = ".shard-000003.safetensors.partial" if mode == "half" else "shard-000003.safetensors"
    assert (out / left).exists()
    _cli(source, out)
    printed = capsys.readouterr().out
    assert (
        "interrupted write" if mode == "half" else "not recorded before an interruption"
    ) in printed
    assert "3 already there" in printed
    _same_store(out, reference)


def test_a_kill_from_outside_mid_run_resumes_to_the_same_store(
    source: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    process = _spawn(source, out, "slow")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        manifest = out / MANIFEST
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2:
            break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not Manifest.load(out).complete
    _cli(source, out)
    _same_store(out, reference)


def test_parts_merge_into_the_unsharded_store(
    source: Path, reference: Path, tmp_path: Path
) -> None:
    parts = [tmp_path / f"part-{i}" for i in range(3)]
    for i, part in enumerate(parts):
        _cli(source, part, "--shard", f"{i}/3")
        assert Manifest.load(part).part == (i, 3)
    with pytest.raises(UserError, match="part 1/3 of a sharded job"):
        CaptureStore(parts[1])
    with pytest.raises(UserError, match=r"parts \[2\] of 3 are missing"):
        merge_stores(parts[:2], tmp_path / "partial-merge")
    with pytest.raises(UserError, match="holds part 0/3"):
        capture(_config(source), parts[0], part="1/3", progress=False)
    merge_stores(list(reversed(parts)), tmp_path / "merged")
    _same_store(tmp_path / "merged", reference)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")]


def test_parts_of_another_job_do_not_merge(source: Path, tmp_path: Path) -> None:
    _cli(source, tmp_path / "a", "--shard", "0/2")
    _cli(source, tmp_path / "b", "--shard", "1/2", "--option", "seed=4")
    with pytest.raises(UserError, match=r"not part of the same capture.*\n.*seed: 3 -> 4"):
        merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "merged")


def _damaged_copy(reference: Path, tmp_path: Path) -> Path:
    out = tmp_path / "store"
    shutil.copytree(reference, out)
    return out


def _config(source: Path) -> CaptureConfig:
    """The job ``ARGS`` describe, for the API."""
    return CaptureConfig(
        model="gpt2", driver="native", boot_options={"n_layers": 2, "seed": 3}, hooks=HOOKS,
        input=str(source), context_size=24, batch_size=2, shard_contexts=4,
    )  # fmt: skip


def _resume_refuses(source: Path, out: Path, match: str) -> None:
    with pytest.raises(UserError, match=match):
        capture(_config(source), out, progress=False)


def test_an_altered_shard_is_refused_by_the_reader_and_by_resume(
    source: Path, reference: Path, tmp_path: Path
) -> None:
    out = _damaged_copy(reference, tmp_path)
    shard = out / "shard-000002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # one activation byte; size and header unchanged
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"shard 2 .* does not match its checksum"):
        CaptureStore(out)
    CaptureStore(out, verify=False)  # sizes and headers still agree
    _resume_refuses(source, out, "does not match its checksum")
    from tl_core.cli import main

    assert main(_command(source, out, "--repair")) == 0
    _same_store(out, reference)


def test_a_missing_or_foreign_shard_and_an_edited_manifest_are_refused(
    source: Path, reference: Path, tmp_path: Path
) -> None:
    out = _damaged_copy(reference, tmp_path)
    (out / "shard-000001.safetensors").unlink()
    with pytest.raises(UserError, match=r"shard 1 .* missing"):
        CaptureStore(out)
    _resume_refuses(source, out, "missing")

    other = tmp_path / "other"
    _cli(source, other, "--option", "seed=4")  # another model's weights
    shutil.copy(other / "shard-000001.safetensors", out / "shard-000001.safetensors")
    with pytest.raises(UserError, match=r"shard 1 .* belongs to another capture"):
        CaptureStore(out)
    _resume_refuses(source, out, "belongs to another capture")

    shutil.copy(reference / "shard-000001.safetensors", out / "shard-000001.safetensors")
    CaptureStore(out)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["shards"][0]["rows"] += 1
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"shard 0 .* holds 96 rows, the manifest says 97"):
        CaptureStore(out)
    manifest["shards"][0]["rows"] -= 1
    manifest["identity"]["config"]["context_size"] = 12
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="was edited: its identity no longer hashes"):
        CaptureStore(out)
    _resume_refuses(source, out, "was edited")
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        CaptureStore(out)


def _edit_manifest(out: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    edit(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _info_refuses(out: Path, capsys: pytest.CaptureFixture[str], *pieces: str) -> str:
    from tl_core.cli import main

    assert main(["capture", "info", str(out), "--no-verify"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "", "info printed a summary of an edited store"
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    for piece in pieces:
        assert piece in captured.err, (piece, captured.err)
    return captured.err


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("tokens", 1000),
        ("first_context", 1),
        ("contexts", -1),
        ("first_document", -1),
        ("last_document", 3),
    ],
)
def test_an_edited_shard_record_is_refused_naming_the_field_and_both_values(
    field: str,
    change: int,
    source: Path,
    reference: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _damaged_copy(reference, tmp_path)
    recorded = json.loads((out / MANIFEST).read_text())["shards"][2][field]
    _edit_manifest(out, lambda m: m["shards"][2].__setitem__(field, recorded + change))
    message = (
        rf"shard 2 \(shard-000002\.safetensors\): the manifest records {field}={recorded + change} "
        rf"but the shard's own header records {field}={recorded}: .*--repair"
    )
    with pytest.raises(UserError, match=message):
        CaptureStore(out, verify=False)  # a cheap check: no checksums needed
    _info_refuses(
        out, capsys, "shard 2", f"{field}={recorded + change}", f"{field}={recorded}", "--repair"
    )
    _resume_refuses(source, out, f"records {field}=")


def test_a_repair_rewrites_an_edited_shard_record(
    source: Path, reference: Path, tmp_path: Path
) -> None:
    from tl_core.cli import main

    out = _damaged_copy(reference, tmp_path)
    _edit_manifest(out, lambda m: m["shards"][1].__setitem__("tokens", 5))
    assert main(_command(source, out, "--repair")) == 0
    _same_store(out, reference)
    assert Manifest.load(out).tokens == Manifest.load(reference).tokens


def test_two_swapped_shard_entries_are_refused(
    reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _damaged_copy(reference, tmp_path)

    def swap_contents(manifest: dict[str, Any]) -> None:  # shard 0 now describes shard 1's file
        first, second = manifest["shards"][0], manifest["shards"][1]
        first["index"], second["index"] = second["index"], first["index"]
        manifest["shards"][0], manifest["shards"][1] = second, first

    _edit_manifest(out, swap_contents)
    with pytest.raises(
        UserError, match=r"shard 0 \(shard-000001\.safetensors\): the manifest records file="
    ):
        CaptureStore(out, verify=False)
    _info_refuses(out, capsys, "shard 0", "shard-000001.safetensors", "shard-000000.safetensors")

    # The same file names, renamed on disk too: the shard numbers in the headers disagree.
    out = _damaged_copy(reference, tmp_path / "renamed")
    _edit_manifest(out, swap_contents)
    _edit_manifest(
        out,
        lambda m: [
            s.__setitem__("file", f"shard-{s['index']:06d}.safetensors") for s in m["shards"]
        ],
    )
    (out / "shard-000000.safetensors").rename(out / "swap")
    (out / "shard-000001.safetensors").rename(out / "shard-000000.safetensors")
    (out / "swap").rename(out / "shard-000001.safetensors")
    with pytest.raises(
        UserError,
        match=r"shard 0 \(shard-000000\.safetensors\): the manifest records index=0 but the shard's own header records index=1",
    ):
        CaptureStore(out, verify=False)

    out = _damaged_copy(reference, tmp_path / "reordered")  # entries moved, each one intact
    _edit_manifest(out, lambda m: m["shards"].insert(0, m["shards"].pop(1)))
    with pytest.raises(
        UserError, match=r"lists shard 1 before shard 0, but tl writes the entries in index order"
    ):
        CaptureStore(out, verify=False)
    _edit_manifest(out, lambda m: m["shards"].__setitem__(0, dict(m["shards"][1])))
    with pytest.raises(UserError, match=r"lists shard 0 twice"):
        CaptureStore(out, verify=False)


def test_edited_totals_and_hooks_in_the_manifest_are_refused(
    source: Path, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tl_core.cli import main

    out = _damaged_copy(reference, tmp_path)
    tokens = Manifest.load(reference).tokens
    _edit_manifest(out, lambda m: m.__setitem__("tokens", tokens + 1))
    with pytest.raises(
        UserError, match=rf"records tokens={tokens + 1}, its shards add up to {tokens}.*--repair"
    ):
        CaptureStore(out, verify=False)
    _resume_refuses(source, out, rf"records tokens={tokens + 1}")
    assert main(_command(source, out, "--repair")) == 0
    assert "repair: rewrote the manifest's totals" in capsys.readouterr().out
    _same_store(out, reference)
    assert json.loads((out / MANIFEST).read_text())["tokens"] == tokens
    shutil.copy(reference / MANIFEST, out / MANIFEST)
    _edit_manifest(
        out, lambda m: m["hooks"]["blocks.1.attn.hook_z"].__setitem__("dtype", "float16")
    )
    with pytest.raises(UserError, match=r"hooks.*blocks\.1\.attn\.hook_z.*float16.*identity"):
        CaptureStore(out, verify=False)


def test_a_shard_without_a_record_in_its_header_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from tl_core.capture._shards import HEADER_KEY, ShardRecord, check_shard, file_sha256

    path = tmp_path / "shard-000000.safetensors"
    header = {
        "format": "tl-capture",
        "fingerprint": "f" * 8,
        "shard": "0",
    }  # as written before records
    save_file(
        {"tokens": torch.zeros(3, dtype=torch.int32)},
        str(path),
        metadata={HEADER_KEY: json.dumps(header)},
    )
    record = ShardRecord(index=0, file=path.name, rows=3, first_context=0, contexts=1, first_document=0,
                         last_document=0, tokens=3, bytes=path.stat().st_size, sha256=file_sha256(path))  # fmt: skip
    with pytest.raises(UserError, match=r"shard 0 .* header records no first_context.*--repair"):
        check_shard(tmp_path, record, "f" * 8, checksum=True)
