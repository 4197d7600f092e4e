"""The GGUF conversion cache: keyed by content and dtype, trusted only when complete.

The conversion itself runs transformers (tested on a real GGUF file in tl-driver-hf's
``test_gguf.py``); here a small torch stand-in with the same four methods plays its part,
so the cache's own logic (keys, the record, interrupted and concurrent writers) is checked
without transformers, which tl-core does not depend on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tl_core import UserError
from tl_core.gguf import (
    CACHE_ENV,
    GGUF_RECORD,
    dequantized_gguf,
    file_sha256,
    gguf_cache_dir,
    gguf_source,
    require_gguf_packages,
)


class _Config:
    def __init__(self) -> None:
        self.quantization_config = {"quant_method": "gguf"}

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in vars(self).items()})


class StandInModel(nn.Module):
    """Loads "weights" derived from the file's bytes, as a GGUF reader would."""

    loads: ClassVar[int] = 0
    fail_after_write: ClassVar[bool] = False

    def __init__(self, config: _Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(4, dtype=dtype))

    @classmethod
    def from_pretrained(cls, folder: str, *, gguf_file: str, dtype: torch.dtype) -> StandInModel:
        cls.loads += 1
        model = cls(_Config(), dtype)
        data = (Path(folder) / gguf_file).read_bytes()[4:8]
        model.weight.data = torch.tensor(list(data), dtype=torch.float32).to(dtype) / 7
        return model

    @classmethod
    def from_config(cls, config: _Config, *, dtype: torch.dtype) -> StandInModel:
        assert not hasattr(config, "quantization_config"), "the saved config must not claim GGUF"
        return cls(config, dtype)

    def save_pretrained(self, out: str) -> None:
        save_file(
            {"weight": self.weight.detach().contiguous()}, str(Path(out) / "model.safetensors")
        )
        if self.fail_after_write:
            raise RuntimeError("disk full (simulated)")
        (Path(out) / "config.json").write_text(self.config.to_json())


class StandInTokenizer:
    @classmethod
    def from_pretrained(cls, folder: str, *, gguf_file: str) -> StandInTokenizer:
        return cls()

    def save_pretrained(self, out: str) -> None:
        (Path(out) / "tokenizer.json").write_text("{}")


def _gguf(path: Path, payload: bytes = b"\x01\x02\x03\x04") -> Path:
    path.write_bytes(b"GGUF" + payload + b"\x00" * 64)
    return path


def _convert(path: Path, cache: Path, dtype: torch.dtype = torch.float32) -> Path:
    return dequantized_gguf(
        path,
        dtype=dtype,
        auto_model=StandInModel,
        auto_tokenizer=StandInTokenizer,
        reason="testing",
        cache_dir=cache,
    )


@pytest.fixture(autouse=True)
def _reset() -> None:
    StandInModel.loads = 0
    StandInModel.fail_after_write = False


def test_converts_once_then_reuses_the_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _gguf(tmp_path / "m.gguf")
    with caplog.at_level(logging.INFO, logger="tl_core.gguf"):
        folder = _convert(source, tmp_path / "cache")
    assert StandInModel.loads == 1
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert (
        "m.gguf: testing, so it is dequantised once to float32 safetensors in"
        in warning.getMessage()
    )
    assert str(folder) in warning.getMessage() and CACHE_ENV in warning.getMessage()
    record = json.loads((folder / GGUF_RECORD).read_text())
    assert record["sha256"] == file_sha256(source) and record["dtype"] == "float32"
    assert set(record["files"]) == {"model.safetensors", "config.json", "tokenizer.json"}
    assert torch.equal(
        load_file(folder / "model.safetensors")["weight"], torch.tensor([1.0, 2, 3, 4]) / 7
    )
    assert _convert(source, tmp_path / "cache") == folder
    assert StandInModel.loads == 1, "a complete folder must be reused, not converted again"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name], (
        "no partial folders left"
    )


def test_file_sha256_reads_a_file_rewritten_in_place_with_the_same_size(tmp_path: Path) -> None:
    """Issue #44: a digest remembered by path, size and mtime went stale on such a rewrite."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x01" * 4096)
    before = path.stat()
    assert file_sha256(path) == hashlib.sha256(b"\x01" * 4096).hexdigest()
    with path.open("r+b") as handle:  # the same inode and size; no sleep before or after
        handle.write(b"\x02" * 4096)
    # A rewrite within the file system's timestamp granularity (or a copy that keeps the
    # mtime) leaves the mtime as it was: make that certain rather than likely.
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_ino) == (before.st_size, before.st_ino)
    assert file_sha256(path) == hashlib.sha256(b"\x02" * 4096).hexdigest()


def test_the_key_follows_the_content_and_the_dtype(tmp_path: Path) -> None:
    first = _convert(_gguf(tmp_path / "m.gguf"), tmp_path / "cache")
    in_bf16 = _convert(tmp_path / "m.gguf", tmp_path / "cache", torch.bfloat16)
    assert in_bf16 != first and in_bf16.name.endswith("-bfloat16")
    assert load_file(in_bf16 / "model.safetensors")["weight"].dtype == torch.bfloat16
    changed = _convert(_gguf(tmp_path / "m.gguf", b"\x09\x09\x09\x09"), tmp_path / "cache")
    assert changed not in (first, in_bf16), "new content under the same name is a new key"
    assert StandInModel.loads == 3


def test_a_failed_conversion_leaves_nothing_a_later_boot_trusts(tmp_path: Path) -> None:
    source = _gguf(tmp_path / "m.gguf")
    StandInModel.fail_after_write = True
    with pytest.raises(RuntimeError, match="disk full"):
        _convert(source, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    StandInModel.fail_after_write = False
    folder = _convert(source, tmp_path / "cache")
    assert (folder / GGUF_RECORD).is_file() and StandInModel.loads == 2


def test_an_incomplete_folder_under_the_final_name_is_replaced(tmp_path: Path) -> None:
    source = _gguf(tmp_path / "m.gguf")
    folder = _convert(source, tmp_path / "cache")
    (folder / "model.safetensors").write_bytes(b"truncated")  # sizes no longer match the record
    again = _convert(source, tmp_path / "cache")
    assert again == folder and StandInModel.loads == 2
    assert load_file(again / "model.safetensors")["weight"].shape == (4,)


_KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
sys.path.insert(0, {tests!r})
import test_gguf_cache as t

class Slow(t.StandInModel):
    def save_pretrained(self, out):
        super().save_pretrained(out)
        print("writing", flush=True)
        time.sleep(60)

t.dequantized_gguf(Path({source!r}), dtype=torch.float32, auto_model=Slow,
                   auto_tokenizer=t.StandInTokenizer, reason="testing", cache_dir=Path({cache!r}))
"""


def test_a_killed_conversion_is_not_trusted_and_its_leftovers_go(tmp_path: Path) -> None:
    source, cache = _gguf(tmp_path / "m.gguf"), tmp_path / "cache"
    code = textwrap.dedent(_KILLED_WRITER).format(
        tests=str(Path(__file__).parent), source=str(source), cache=str(cache)
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "writing"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    leftovers = [p.name for p in cache.iterdir()]
    assert len(leftovers) == 1 and ".partial-" in leftovers[0], leftovers
    folder = _convert(source, cache)
    assert StandInModel.loads == 1, "the killed writer's half folder must not be used"
    assert [p.name for p in cache.iterdir()] == [folder.name], (
        "the dead writer's partial folder is removed"
    )


def test_two_writers_at_once_both_get_the_finished_folder(tmp_path: Path) -> None:
    source, cache = _gguf(tmp_path / "m.gguf"), tmp_path / "cache"
    both_writing = threading.Barrier(2, timeout=30)

    class Overlapping(StandInModel):
        def save_pretrained(self, out: str) -> None:
            super().save_pretrained(out)
            both_writing.wait()  # each writer has a full partial folder before either renames

    results: list[Path] = []

    def convert() -> None:
        results.append(
            dequantized_gguf(
                source,
                dtype=torch.float32,
                auto_model=Overlapping,
                auto_tokenizer=StandInTokenizer,
                reason="testing",
                cache_dir=cache,
            )
        )

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 2 and results[0] == results[1]
    assert Overlapping.loads == 2, "both converted (neither waited for the other)"
    assert [p.name for p in cache.iterdir()] == [results[0].name], (
        "the loser's partial folder is removed"
    )
    assert (results[0] / GGUF_RECORD).is_file()


def test_gguf_source_names_what_is_wrong(tmp_path: Path) -> None:
    assert gguf_source(str(tmp_path)) is None  # a folder is a checkpoint, not a GGUF file
    assert gguf_source("org/model") is None
    with pytest.raises(UserError, match=r"GGUF file '.*missing.gguf' does not exist"):
        gguf_source(str(tmp_path / "missing.gguf"))
    (tmp_path / "fake.gguf").write_text("{}")
    with pytest.raises(
        UserError, match=r"is not a GGUF file: it starts with b'\{\}', a GGUF file with b'GGUF'"
    ):
        gguf_source(str(tmp_path / "fake.gguf"))
    source = _gguf(tmp_path / "m.gguf")
    assert gguf_source(str(tmp_path), "m.gguf") == source.resolve()
    with pytest.raises(UserError, match="needs the model to be the folder that holds it"):
        gguf_source(str(source), "m.gguf")
    with pytest.raises(UserError, match=r"gguf_file='m.gguf' names a file inside a folder"):
        gguf_source(None, "m.gguf")
    with pytest.raises(UserError, match=r"gguf_file='other.gguf' in folder .* does not exist"):
        gguf_source(str(tmp_path), "other.gguf")


def test_the_cache_folder_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache_dir() == tmp_path / "xdg" / "tl" / "gguf"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "tl"))
    assert gguf_cache_dir() == tmp_path / "tl" / "gguf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv(CACHE_ENV)
    assert gguf_cache_dir() == Path.home() / ".cache" / "tl" / "gguf"


def test_an_unwritable_cache_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(
        UserError,
        match=rf"cannot create the GGUF cache folder .*; set {CACHE_ENV} to a writable folder",
    ):
        _convert(_gguf(tmp_path / "m.gguf"), blocker / "cache")


@pytest.mark.parametrize(
    ("absent", "named"),
    [
        ({"gguf"}, "the 'gguf' package"),
        ({"gguf", "accelerate"}, "the 'gguf' and 'accelerate' packages"),
    ],
)
def test_missing_reader_packages_name_the_extra(
    monkeypatch: pytest.MonkeyPatch, absent: set[str], named: str
) -> None:
    import importlib.util

    # Decide presence for both names, so the result does not depend on what this env installed.
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in absent else object()
    )
    with pytest.raises(UserError, match=rf"needs {named}, .*install with: pip install 'x\[gguf\]'"):
        require_gguf_packages("pip install 'x[gguf]'")
