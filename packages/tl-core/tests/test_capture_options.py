"""Options of capture jobs and store reads that would be ignored or fail late are refused
at once, by name (issue #47, "Options").

An option that another option leaves unread (``--sae-top-k`` without ``--sae``, a text
field of a plain text input, a shuffle seed of an ordered read) is refused as ``--parts``
without ``--ray`` is; a value of the wrong kind is a ``UserError`` naming the argument,
raised when the call is made, before any model boots or any row is read; a device this
machine lacks is named with those it has.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tl_core import UserError
from tl_core.capture import CaptureConfig, CaptureStore, capture, capture_on_ray, export_sae_lens
from tl_core.cli import main

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, write_documents: Callable[..., Path]) -> Path:
    return write_documents(tmp_path_factory.mktemp("input") / "docs.txt", n=20)


def _args(source: Path, output: Path, *extra: str, model: str = "gpt2") -> list[str]:
    return [
        "capture", "run", "--model", model, "--driver", "native", "--option", "n_layers=1",
        "--hooks", HOOK, "--input", str(source), "--output", str(output),
        "--context-size", "16", "--quiet", *extra,
    ]  # fmt: skip


def _one_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``tl``; it must fail with exactly one ``tl: error:`` line and no traceback."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert err.startswith("tl: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--sae-top-k", "8"], "--sae-top-k 8"),
        (["--part-cpus", "2"], "--part-cpus"),
        (["--part-gpus", "1"], "--part-gpus"),
        (["--max-retries", "5"], "--max-retries"),
        (["--connect-timeout", "9"], "--connect-timeout"),
        (["--keep-parts"], "--keep-parts"),
        (["--parts", "2"], "--parts"),
        (["--no-pack", "--separator", "eos"], "--separator eos"),
        (["--text-field", "body"], "text_field='body' (--text-field)"),
    ],
)
def test_an_option_nothing_would_read_is_refused(
    extra: list[str],
    named: str,
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _one_error(_args(source, tmp_path / "store", *extra), capsys)
    assert named in err and ("drop" in err or "add --ray" in err), err
    assert not (tmp_path / "store").exists()


def test_a_bad_model_dictionary_or_text_field_is_one_error_line(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "store"
    err = _one_error(_args(source, out, model="./no-such-model"), capsys)
    assert "./no-such-model" in err
    err = _one_error(_args(source, out, "--sae", str(tmp_path / "no-sae")), capsys)
    assert str(tmp_path / "no-sae") in err
    damaged = tmp_path / "damaged-sae"
    damaged.mkdir()
    (damaged / "cfg.json").write_text('{"d_in": 4,')  # truncated
    (damaged / "sae_weights.safetensors").write_bytes(b"\x00" * 16)  # not safetensors
    assert str(damaged) in _one_error(_args(source, out, "--sae", str(damaged)), capsys)
    records = tmp_path / "docs.jsonl"
    records.write_text(json.dumps({"body": "the cat sat"}) + "\n")
    err = _one_error(_args(records, out, "--text-field", "text"), capsys)
    assert "'text'" in err and "line 1" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pack": "no"}, r"pack must be True or False, got 'no'"),
        ({"drop_bos": 1}, r"drop_bos must be True or False, got 1"),
        ({"text_field": ""}, r"text_field must be the name"),
        ({"hooks": (HOOK, 3)}, r"hooks must be hook names \(strings\), got 3"),
        ({"boot_options": [("n_layers", 1)]}, r"boot_options must be a mapping"),
        ({"driver": ""}, r"driver must be a driver name"),
        ({"pack": False, "separator": "none"}, r"separator='none' \(--separator\).*ignored"),
        ({"dictionaries": [{"path": "x", "top_k": 0}]}, r"\['top_k'\] \(--sae-top-k\) must be an int >= 1"),
        ({"dictionaries": [{"path": "x", "use_error_term": "yes"}]}, r"use_error_term'\] must be True or False"),
        ({"dictionaries": [{"path": "x", "hook_name": 7}]}, r"\['hook_name'\] must be a hook name"),
    ],
)  # fmt: skip
def test_a_config_value_of_the_wrong_kind_is_refused_by_name(
    changes: dict[str, Any], message: str, source: Path
) -> None:
    fields: dict[str, Any] = {
        "model": "gpt2",
        "driver": "native",
        "hooks": (HOOK,),
        "input": source,
    }
    with pytest.raises(UserError, match=message):
        CaptureConfig(**{**fields, **changes})


@pytest.fixture(scope="module")
def store(source: Path, tmp_path_factory: pytest.TempPathFactory) -> CaptureStore:
    config = CaptureConfig(
        model="gpt2", driver="native", boot_options={"n_layers": 1}, hooks=(HOOK,),
        input=source, context_size=16, batch_size=2, shard_contexts=4,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("store") / "store"
    capture(config, out, progress=False)
    return CaptureStore(out)


def _unavailable() -> str:
    """A device name this machine does not have."""
    return "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shuffle": True, "buffer_rows": -1}, r"buffer_rows must be an int >= 1.*got -1"),
        ({"shuffle": True, "buffer_rows": 0}, r"buffer_rows must be an int >= 1.*got 0"),
        ({"buffer_rows": 100}, r"buffer_rows=100 only affects a shuffled read.*shuffle=True"),
        ({"shuffle": True, "seed": "abc"}, r"seed must be an int .*got 'abc'"),
        ({"shuffle": True, "seed": 2**64}, r"seed must be an int"),
        ({"seed": 3}, r"seed=3 only affects a shuffled read"),
        ({"shuffle": "yes"}, r"shuffle must be True or False, got 'yes'"),
        ({"drop_last": None}, r"drop_last must be True or False, got None"),
        ({"fields": "tokens"}, r"fields must be a list .*fields=\['tokens'\]"),
        ({"device": "meta"}, r"device='meta' holds no data.*this machine has cpu"),
        ({"device": "gpu:x"}, r"device='gpu:x' is not a torch device.*this machine has cpu"),
    ],
)  # fmt: skip
def test_iter_batches_refuses_a_bad_argument_when_called(
    options: dict[str, Any], message: str, store: CaptureStore
) -> None:
    # Raised by the call itself: no batch is asked for.
    with pytest.raises(UserError, match=message):
        store.iter_batches(HOOK, 8, **options)


def test_a_device_this_machine_lacks_is_named_with_those_it_has(store: CaptureStore) -> None:
    device = _unavailable()
    with pytest.raises(UserError, match=rf"device={device!r} is not available here") as error:
        store.iter_batches(HOOK, 8, device=device)
    assert "this machine has cpu" in str(error.value)
    batches = list(store.iter_batches(HOOK, 64, device="cpu", shuffle=True, seed=0))
    assert sum(len(b) for b in batches) == len(store)


def test_reads_and_exports_refuse_arguments_of_the_wrong_kind(
    store: CaptureStore, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match=r"read: start must be a row number \(int\), got 1.5"):
        store.read(HOOK, 1.5)  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"fields must be a list"):
        store.dataset(HOOK, fields="tokens")
    with pytest.raises(UserError, match=r"hooks must be a list of hook names, got the string"):
        export_sae_lens(store, tmp_path / "export", hooks=HOOK)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_retries": "3"}, r"max_retries \(--max-retries\) must be a whole number >= 0"),
        ({"max_retries": -1}, r"max_retries \(--max-retries\) must be a whole number >= 0"),
        (
            {"connect_timeout": 0, "address": "127.0.0.1:1"},
            r"connect_timeout must be a number of seconds > 0",
        ),
        (
            {"connect_timeout": 5},
            r"connect_timeout=5 \(--connect-timeout\) bounds joining a running cluster",
        ),
        ({"progress_interval": -1.0}, r"progress_interval must be a number of seconds > 0"),
        ({"part_cpus": "2"}, r"part_cpus must be a number"),
        ({"address": 6379}, r"address must be 'host:port', 'auto' or None"),
    ],
)
def test_capture_on_ray_refuses_bad_options_before_anything_else(
    options: dict[str, Any], message: str, source: Path, tmp_path: Path
) -> None:
    config = CaptureConfig(model="gpt2", driver="native", hooks=(HOOK,), input=source)
    with pytest.raises(UserError, match=message):
        capture_on_ray(config, tmp_path / "store", parts=2, **options)
    assert not list(tmp_path.iterdir())
