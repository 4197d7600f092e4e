"""``tl capture`` on the native driver: the store holds what run_with_cache returns.

The expected contexts are cut here from the input by the rules the docs state (BOS first,
documents joined by a separator, full contexts), independently of the capture code; the
expected activations come from ``run_with_cache`` on those contexts, one at a time.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tl_core import TransformerBridge, UserError
from tl_core.capture import CaptureConfig, CaptureStore, capture
from tl_core.capture._job import stop_layer
from tl_core.capture._progress import Progress
from tl_core.cli import main

MODEL = {"model": "gpt2", "driver": "native", "boot_options": {"n_layers": 2, "seed": 3}}
HOOKS = ("blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.mlp.hook_post")
BOS, EOS, PAD = 256, 257, 258


def config(source: Path, **changes: Any) -> CaptureConfig:
    fields: dict[str, Any] = {
        **MODEL,
        "hooks": HOOKS,
        "input": str(source),
        "context_size": 24,
        "batch_size": 3,
        "shard_contexts": 6,
    }
    return CaptureConfig(**{**fields, **changes})


@pytest.fixture
def source(tmp_path: Path, write_documents: Callable[..., Path]) -> Path:
    return write_documents(tmp_path / "docs.txt")


@pytest.fixture(scope="module")
def native() -> TransformerBridge:
    return TransformerBridge.boot_native("gpt2", n_layers=2, seed=3)


def expected_contexts(path: Path, size: int, pack: bool = True) -> list[list[int]]:
    """Contexts by the documented rules, for the byte tokenizer (ids are UTF-8 bytes)."""
    documents = [list(line.encode()) for line in path.read_text().split("\n")[:-1]]
    documents = [d for d in documents if d]
    if not pack:
        return [[BOS, *d[i : i + size - 1]] for d in documents for i in range(0, len(d), size - 1)]
    stream: list[int] = []
    for i, d in enumerate(documents):
        stream += ([BOS] if i else []) + d
    return [[BOS, *stream[i : i + size - 1]] for i in range(0, len(stream), size - 1)]


def test_the_store_holds_run_with_cache_of_each_context(
    source: Path, tmp_path: Path, native: TransformerBridge
) -> None:
    summary = capture(config(source), tmp_path / "store", progress=False)
    assert (
        summary.complete
        and summary.shards_written == summary.shards_before + summary.shards_written
    )
    store = CaptureStore(tmp_path / "store")
    wanted = expected_contexts(source, 24)
    assert len(store) == sum(len(c) for c in wanted)
    assert store.read("tokens").tolist() == [t for c in wanted for t in c]
    assert store.read("contexts").tolist() == [i for i, c in enumerate(wanted) for _ in c]
    assert store.read("positions").tolist() == [p for c in wanted for p in range(len(c))]
    row = 0
    for tokens in wanted:
        _, cache = native.run_with_cache(torch.tensor([tokens]), names_filter=list(HOOKS))
        for hook in HOOKS:
            got = store.read(hook, row, row + len(tokens))
            torch.testing.assert_close(got, cache[hook][0], atol=1e-6, rtol=0, msg=hook)
        row += len(tokens)
    assert summary.rows_written == len(store) and summary.tokens_written == len(store)


def test_documents_are_traced_to_every_row(source: Path, tmp_path: Path) -> None:
    capture(config(source), tmp_path / "store", progress=False)
    store = CaptureStore(tmp_path / "store")
    lines = source.read_text().split("\n")[:-1]
    tokens, documents = store.read("tokens").tolist(), store.read("documents").tolist()
    for token, document in zip(tokens, documents, strict=True):
        if document < 0:
            assert token == BOS  # inserted tokens belong to no document
        else:
            assert token in lines[document].encode()
    assert sorted({d for d in documents if d >= 0}) == [i for i, line in enumerate(lines) if line]


def test_unpacked_contexts_padding_and_dropped_bos(source: Path, tmp_path: Path) -> None:
    capture(config(source, pack=False, drop_bos=True), tmp_path / "ragged", progress=False)
    ragged = CaptureStore(tmp_path / "ragged")
    wanted = expected_contexts(source, 24, pack=False)
    assert ragged.read("tokens").tolist() == [t for c in wanted for t in c[1:]]
    assert BOS not in ragged.read("tokens").tolist()
    capture(config(source, pack=False, drop_padding=False), tmp_path / "padded", progress=False)
    padded = CaptureStore(tmp_path / "padded")
    assert len(padded) == 24 * len(wanted)
    tokens = padded.read("tokens").reshape(len(wanted), 24)
    for row, context in zip(tokens.tolist(), wanted, strict=True):
        assert row == context + [PAD] * (24 - len(context))


def test_jsonl_input_max_tokens_dtype_and_steering(
    tmp_path: Path, native: TransformerBridge
) -> None:
    lines = [json.dumps({"text": f"document number {i} " * 3, "id": i}) for i in range(12)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    steer = {"blocks.0.hook_resid_post": {"op": "add", "value": 1.0}}
    # One block-0 hook: the forwards stop after block 0.
    cfg = config(
        tmp_path / "docs.jsonl",
        hooks=("blocks.0.hook_resid_post",),
        max_tokens=100,
        dtype="float16",
        intervene=steer,
    )
    capture(cfg, tmp_path / "store", progress=False)
    store = CaptureStore(tmp_path / "store")
    assert store.manifest.tokens == 120  # five 24-token contexts: the one reaching 100 is whole
    first = store.read("tokens", 0, 24)
    _, cache = native.run_with_cache(
        first[None].long(), names_filter="blocks.0.hook_resid_post", intervene=steer
    )
    got = store.read("blocks.0.hook_resid_post", 0, 24)
    assert got.dtype == torch.float16
    torch.testing.assert_close(
        got.float(), cache["blocks.0.hook_resid_post"][0], atol=2e-3, rtol=1e-3
    )


def test_reader_streams_shuffles_and_serves_a_dataset(source: Path, tmp_path: Path) -> None:
    capture(config(source), tmp_path / "store", progress=False)
    store = CaptureStore(tmp_path / "store")
    every = store.read("blocks.1.attn.hook_z")
    batches = list(store.iter_batches("blocks.1.attn.hook_z", batch_size=50))
    assert [len(b) for b in batches[:-1]] == [50] * (len(batches) - 1)
    torch.testing.assert_close(torch.cat(batches), every, atol=0, rtol=0)
    mixed = list(
        store.iter_batches(
            "blocks.0.hook_resid_post", 64, fields=["tokens"], shuffle=True, seed=1, buffer_rows=200
        )
    )
    rows = torch.cat([b["blocks.0.hook_resid_post"] for b in mixed])
    assert not torch.equal(rows, store.read("blocks.0.hook_resid_post"))
    order = torch.cat([b["tokens"] for b in mixed])
    assert sorted(order.tolist()) == sorted(store.read("tokens").tolist())
    # Sorting both row sets the same way shows the shuffle is a permutation of the rows.
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(rows) == key(store.read("blocks.0.hook_resid_post"))
    again = torch.cat(
        [
            b["tokens"]
            for b in store.iter_batches(
                "resid_post.0", 64, fields=["tokens"], shuffle=True, seed=1, buffer_rows=200
            )
        ]
    )
    assert torch.equal(order, again)
    dataset = store.dataset("blocks.0.hook_resid_post", fields=["tokens"])
    assert len(dataset) == len(store)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=False)
    torch.testing.assert_close(
        torch.cat([b["blocks.0.hook_resid_post"] for b in loader]),
        store.read("blocks.0.hook_resid_post"),
    )
    with pytest.raises(UserError, match="not in the store"):
        store.read("blocks.1.hook_resid_post")


def test_a_completed_store_is_left_alone_and_a_changed_job_is_refused(
    source: Path, tmp_path: Path
) -> None:
    capture(config(source), tmp_path / "store", progress=False)
    files = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "store").iterdir()}
    again = capture(config(source), tmp_path / "store", progress=False)
    assert (again.shards_written, again.complete) == (0, True)
    assert files == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "store").iterdir()}
    with pytest.raises(UserError, match=r"config\.context_size: 24 -> 32") as error:
        capture(config(source, context_size=32), tmp_path / "store", progress=False)
    assert "new output folder" in str(error.value)
    source.write_text(source.read_text() + "one more document\n")
    with pytest.raises(UserError, match="input_digest"):
        capture(config(source), tmp_path / "store", progress=False)


def test_bad_jobs_fail_before_the_model_boots(source: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        capture(config(tmp_path / "missing.txt"), tmp_path / "a", progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty and holds no capture store"):
        capture(config(source), tmp_path / "busy", progress=False)
    with pytest.raises(UserError, match="multiple of batch_size"):
        config(source, shard_contexts=7)
    with pytest.raises(UserError, match=r"hook_pattern.*fixed width"):
        capture(
            config(source, hooks=("blocks.0.attn.hook_pattern",)), tmp_path / "b", progress=False
        )
    with pytest.raises(UserError, match="0 <= i < N"):
        capture(config(source), tmp_path / "c", part="3/3", progress=False)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(UserError, match="holds no document to capture: its 2 lines are all empty"):
        capture(config(tmp_path / "empty.txt"), tmp_path / "d", progress=False)


def test_a_live_writer_holds_the_store(source: Path, tmp_path: Path) -> None:
    import os
    import socket

    capture(config(source, max_tokens=30), tmp_path / "store", progress=False)
    (tmp_path / "store" / ".lock").write_text(f"{os.getpid()} {socket.gethostname()}")
    with pytest.raises(UserError, match=f"process {os.getpid()}"):
        capture(config(source, max_tokens=30), tmp_path / "store", progress=False)
    (tmp_path / "store" / ".lock").write_text(f"999999999 {socket.gethostname()}")  # a dead process
    assert capture(config(source, max_tokens=30), tmp_path / "store", progress=False).complete


def test_forwards_stop_after_the_last_captured_block() -> None:
    assert stop_layer(["blocks.0.hook_out", "embed.hook_out"], 3) == 1
    assert stop_layer(["blocks.1.attn.hook_z"], 3) == 2
    assert stop_layer(["blocks.2.hook_out"], 3) is None  # the last block: run to the end
    assert stop_layer(["blocks.0.hook_out", "ln_final.hook_normalized"], 3) is None


def test_progress_reports_rate_share_and_eta() -> None:
    stream = io.StringIO()
    progress = Progress(stream=stream, log_interval=0.0)
    progress.update(tokens=1000, fraction=0.25)
    progress.update(shards=1, fraction=0.5)
    line = stream.getvalue().splitlines()[-1]
    assert (
        line.startswith("capture: 1,000 tokens, ")
        and "1 shards written, 50% of the input, ETA 0:00:0" in line
    )


def test_the_command_line_runs_reports_and_inspects(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "store"
    args = ["capture", "run", "--model", "gpt2", "--driver", "native", "--option", "n_layers=2", "--option", "seed=3",
            "--hooks", "resid_post.0", "--input", str(source), "--output", str(out), "--context-size", "24",
            "--batch-size", "3", "--shard-contexts", "6", "--quiet"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"{out}:" in printed and "the store is complete" in printed
    assert main(["capture", "info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "blocks.0.hook_out (asked as resid_post.0): rows of [64] float32" in info
    assert main([*args[:-1], "--context-size", "16"]) == 1
    assert "context_size: 24 -> 16" in capsys.readouterr().err
