"""What a run sends back: one ``[batch, width, ...]`` tensor per hook, carried as the tensor
itself in-process, through shared-memory files between processes on one machine, as bytes
anywhere else; logits only when asked (all positions or the last), in the engine's dtype."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tl_core import UserError  # noqa: E402
from tl_driver_vllm import _wire  # noqa: E402
from tl_driver_vllm._driver_side._merge import merge_batched  # noqa: E402
from tl_driver_vllm._wire import Outbox, SharedFiles  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def files() -> Iterator[SharedFiles]:
    shared = SharedFiles()
    if shared.folder is None:
        pytest.skip("no writable /dev/shm on this machine")
    yield shared
    shared.close()


def _result(batched: dict[str, Any]) -> dict[str, Any]:
    return {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "batched": batched}


def test_in_process_buffers_are_handed_over_as_they_are() -> None:
    outbox = Outbox(raw=True, offer={"dir": "/dev/shm", "token": "unused"})
    buffer = outbox.empty((2, 3, 4), torch.float32, CPU)
    assert not outbox.shared
    sent = outbox.send(buffer)
    assert isinstance(sent, torch.Tensor) and sent.data_ptr() == buffer.data_ptr(), "no copy"


def test_shared_memory_round_trip_leaves_no_files(files: SharedFiles) -> None:
    assert files.folder is not None
    outbox = Outbox(raw=False, offer=files.offer())
    assert outbox.shared
    capture = outbox.empty((3, 5, 8), torch.float32, CPU)
    assert not capture.any(), "shared-memory pages start zeroed"
    capture.copy_(torch.randn(3, 5, 8))
    internal = outbox.empty((3, 5, 8), torch.float32, CPU)  # recorded, never sent
    internal.fill_(1.0)
    pattern = torch.rand(3, 2, 5, 5).to(torch.bfloat16)  # computed after the run: copied once
    sent = {"a": outbox.send(capture), "p": outbox.send(pattern)}
    assert all(isinstance(p, dict) and "file" in p and "data" not in p for p in sent.values()), sent
    outbox.finish()
    assert len(os.listdir(files.folder)) == 1 + 2, "the unsent buffer's file is removed"
    (received,) = files.receive([_result(sent)])
    assert os.listdir(files.folder) == ["probe"], "files are unlinked as soon as they are mapped"
    merged = merge_batched([received], vocab=10, check_ranks=False)
    assert torch.equal(merged["a"], capture) and torch.equal(merged["p"], pattern)
    assert merged["p"].dtype == torch.bfloat16
    merged["a"][0, 0, 0] = 123.0  # a private mapping: the caller may write into it
    assert capture[0, 0, 0] != 123.0
    folder = files.folder
    files.close()
    files.close()
    assert not Path(folder).exists()


def test_a_worker_elsewhere_sends_bytes(files: SharedFiles, tmp_path: Path) -> None:
    # Another host has no such folder; a folder of the same name there has another probe.
    (tmp_path / "probe").write_text("someone else's", encoding="ascii")
    for offer in (
        {"dir": "/nonexistent/tl-vllm", "token": "x"},
        {"dir": str(tmp_path), "token": "x"},
        None,
    ):
        outbox = Outbox(raw=False, offer=offer)
        buffer = outbox.empty((2, 3), torch.float32, CPU)
        buffer.copy_(torch.arange(6.0).view(2, 3))
        packed = outbox.send(buffer)
        assert not outbox.shared and isinstance(packed["data"], bytes), offer
        (received,) = files.receive([_result({"a": packed})])
        assert torch.equal(merge_batched([received], vocab=1, check_ranks=False)["a"], buffer)
    assert sorted(os.listdir(tmp_path)) == ["probe"]


#: A worker process: captures one buffer through an ``Outbox`` given the driver's offer, and
#: prints whether it used shared memory and what it sent (pickled, hex).
_WORKER = """
import json, pickle, sys, torch
from tl_driver_vllm._wire import Outbox
outbox = Outbox(raw=False, offer=json.loads(sys.argv[1]))
buffer = outbox.empty((4, 3), torch.float32, torch.device("cpu"))
buffer.copy_(torch.arange(12.0).view(4, 3))
sent = outbox.send(buffer)
outbox.finish()
print(pickle.dumps((outbox.shared, sent)).hex())
"""


@pytest.mark.parametrize("node", ["this machine", "another node"])
def test_a_worker_chooses_its_carrier_by_what_it_can_see(files: SharedFiles, node: str) -> None:
    """A worker on another node (here: a process in its own mount namespace, with its own
    empty /dev/shm, as a Ray worker on another host has) cannot read the driver's probe and
    sends bytes; a worker on this machine writes into the driver's folder. Both arrive
    equal."""
    import json
    import pickle
    import shutil
    import subprocess
    import sys

    command = [sys.executable, "-c", _WORKER, json.dumps(files.offer())]
    if node == "another node":
        if shutil.which("unshare") is None:
            pytest.fail(
                "this test needs util-linux's unshare (a worker in its own mount namespace)"
            )
        namespace = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
        script = 'mount -t tmpfs tl-other-node /dev/shm && exec "$@"'
        command = [*namespace, "sh", "-c", script, "sh", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shared, sent = pickle.loads(bytes.fromhex(done.stdout.strip()))
    if node == "another node":
        assert not shared and isinstance(sent["data"], bytes) and "file" not in sent
    else:
        assert shared and "file" in sent and "data" not in sent
    (received,) = files.receive([_result({"a": sent})])
    merged = merge_batched([received], vocab=1, check_ranks=False)
    assert torch.equal(merged["a"], torch.arange(12.0).view(4, 3))
    assert files.folder is not None and os.listdir(files.folder) == ["probe"]


def test_full_shared_memory_falls_back_to_bytes(
    files: SharedFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert files.folder is not None
    outbox = Outbox(raw=False, offer=files.offer())
    first = outbox.empty((2, 4), torch.float32, CPU)
    first.fill_(2.0)
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_wire.os, "posix_fallocate", full)
    second = outbox.empty((2, 4), torch.float32, CPU)  # a plain buffer now
    second.fill_(3.0)
    assert not outbox.shared
    sent = {"first": outbox.send(first), "second": outbox.send(second)}
    assert "file" in sent["first"] and "data" in sent["second"]
    monkeypatch.setattr(_wire.os, "posix_fallocate", real)
    outbox.finish()
    (received,) = files.receive([_result(sent)])
    merged = merge_batched([received], vocab=1, check_ranks=False)
    assert torch.equal(merged["first"], first) and torch.equal(merged["second"], second)
    assert os.listdir(files.folder) == ["probe"]


def test_a_failed_run_removes_its_files(files: SharedFiles) -> None:
    assert files.folder is not None
    outbox = Outbox(raw=False, offer=files.offer())
    outbox.send(outbox.empty((4, 4), torch.float32, CPU))
    outbox.empty((4, 4), torch.int64, CPU)
    assert len(os.listdir(files.folder)) == 3
    outbox.discard()
    outbox.discard()
    assert os.listdir(files.folder) == ["probe"]


# -- a real engine ------------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], list(range(20, 60))]


@pytest.fixture(scope="module")
def bridge(checkpoint: Any) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from _tlv_support import ENGINE_OPTIONS

    from tl_core import RemoteBridge

    bridge = RemoteBridge.boot_vllm(checkpoint("llama"), dtype="float32", **ENGINE_OPTIONS)
    yield bridge
    bridge.close()


def _collected(bridge: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the workers return from each run's ``tl_collect``."""
    llm = bridge.driver._llm
    original = llm.collective_rpc
    seen: list[Any] = []

    def spy(method: str, *args: Any, **kwargs: Any) -> Any:
        out = original(method, *args, **kwargs)
        if method == "tl_collect":
            seen.append(out)
        return out

    monkeypatch.setattr(llm, "collective_rpc", spy)
    return seen


@pytest.mark.vllm
@pytest.mark.slow
def test_last_position_logits_are_the_last_rows(
    bridge: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = bridge.driver
    full = driver.forward(PROMPTS, max_new_tokens=0).logits
    seen = _collected(bridge, monkeypatch)
    last = driver.forward(PROMPTS, max_new_tokens=0, return_logits="last").logits
    assert last.shape == (3, 1, driver.info.d_vocab) and last.dtype == full.dtype == torch.float32
    for b, ids in enumerate(PROMPTS):
        gap = float((last[b, 0] - full[b, len(ids) - 1]).abs().max())
        assert gap <= 1e-5, f"prompt {b}: last-position logits differ by {gap:.3g}"
    shipped = seen[0][0]["batched"]
    assert shipped["logits"].shape[:2] == (3, 1), "only the last rows are computed and sent"


@pytest.mark.vllm
@pytest.mark.slow
def test_no_logits_are_computed_or_sent_when_not_asked(
    bridge: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _collected(bridge, monkeypatch)
    result = bridge.driver.forward(
        PROMPTS, capture=["blocks.1.hook_out"], max_new_tokens=0, return_logits=False
    )
    assert result.logits is None and result.captured["blocks.1.hook_out"].shape[:2] == (3, 40)
    out, cache = bridge.run_with_cache(
        PROMPTS, names_filter=["blocks.0.hook_out"], return_type=None
    )
    assert out is None and cache["blocks.0.hook_out"].shape[:2] == (3, 40)
    assert len(seen) == 2
    for run in seen:
        names = sorted(run[0]["batched"])
        assert "logits" not in names and "__normed__" not in names, names


@pytest.mark.vllm
@pytest.mark.slow
def test_in_process_edit_tables_reach_the_workers_as_tensors(
    bridge: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = bridge.driver._llm
    original = llm.collective_rpc
    configs: list[Any] = []

    def spy(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "tl_begin":
            configs.append(kwargs.get("args", args[0] if args else None)[0])
        return original(method, *args, **kwargs)

    monkeypatch.setattr(llm, "collective_rpc", spy)
    hook = "blocks.0.hook_out"
    plain = bridge.driver.forward(PROMPTS, max_new_tokens=0).logits
    steered = bridge.driver.forward(
        PROMPTS, intervene={hook: {"op": "add", "value": 1.0, "pos": -1}}, max_new_tokens=0
    )
    assert not torch.equal(plain, steered.logits)
    # One stacked table for the run's hook, every prompt's rows in it, sent as tensors.
    table = configs[-1]["tables"][hook]
    assert isinstance(table["scale"], torch.Tensor) and isinstance(table["bias"], torch.Tensor)
    firsts = [request["edits"][hook][0] for request in configs[-1]["requests"]]
    lengths = [len(p) for p in PROMPTS]
    assert firsts == [sum(n + 1 for n in lengths[:i]) for i in range(3)]
    assert table["scale"].shape[0] == sum(n + 1 for n in lengths)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_bad_return_logits_is_refused_before_the_engine(
    bridge: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _collected(bridge, monkeypatch)
    for bad in ("first", 1, None):
        with pytest.raises(UserError, match=r"return_logits must be True .* 'last'"):
            bridge.driver.forward(PROMPTS, max_new_tokens=0, return_logits=bad)
    assert seen == []


@pytest.mark.vllm
@pytest.mark.slow
def test_bfloat16_logits_stay_bfloat16(checkpoint: Any) -> None:
    pytest.importorskip("vllm")
    from _tlv_support import ENGINE_OPTIONS

    from tl_core import RemoteBridge

    with RemoteBridge.boot_vllm(
        checkpoint("llama", "bfloat16"), dtype="bfloat16", **ENGINE_OPTIONS
    ) as bf16:
        out = bf16.driver.forward(PROMPTS, max_new_tokens=0)
        last = bf16.driver.forward(PROMPTS, max_new_tokens=0, return_logits="last")
    assert out.logits.dtype == last.logits.dtype == torch.bfloat16
    # One row through the unembedding or all of them: bf16 matmuls may round differently.
    torch.testing.assert_close(last.logits[1, 0], out.logits[1, 1], atol=0.05, rtol=0.02)
