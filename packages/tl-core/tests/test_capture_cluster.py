"""The parts of ``capture_on_ray`` that need no cluster: the bound on contexts checked
before any engine boots, a retried part's lock, the resources a part asks for, the message
when Ray is not installed, and the merge that trusts the parts' own verification. (The
cluster itself: ``tests-ray``, ``nox -s ray``.)"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from tl_core import UserError
from tl_core.capture import CaptureConfig, capture, capture_on_ray, merge_stores
from tl_core.capture._cluster import part_resources
from tl_core.capture._contexts import contexts, most_contexts
from tl_core.capture._lock import LOCK, StoreLock
from tl_core.capture._source import Document
from tl_core.driver_api import ByteTokenizer

_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(_TEXT, max_size=12),
    context_size=st.integers(2, 40),
    pack=st.booleans(),
    prepend_bos=st.booleans(),
    separator=st.sampled_from(["bos", "eos", "none"]),
    max_tokens=st.none() | st.integers(1, 200),
)
def test_the_bound_holds_for_every_input(
    texts: list[str],
    context_size: int,
    pack: bool,
    prepend_bos: bool,
    separator: str,
    max_tokens: int | None,
) -> None:
    config = CaptureConfig(
        model="gpt2", driver="native", hooks=("blocks.0.hook_resid_post",), input="-",
        context_size=context_size, pack=pack, prepend_bos=prepend_bos,
        separator=separator if pack else "bos", max_tokens=max_tokens,  # type: ignore[arg-type]
    )  # fmt: skip
    documents = [Document(i, t, (i + 1) / len(texts)) for i, t in enumerate(texts)]
    cut = sum(1 for _ in contexts(documents, ByteTokenizer(), config))
    assert cut <= most_contexts(documents, config)


def _job(source: Path) -> CaptureConfig:
    return CaptureConfig(
        model="gpt2", driver="native", boot_options={"n_layers": 2}, input=str(source),
        hooks=("blocks.0.hook_resid_post",), context_size=24, batch_size=2, shard_contexts=4,
    )  # fmt: skip


def test_more_parts_than_shards_are_refused_before_ray_is_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = tmp_path / "small.txt"
    small.write_text("the cat sat\non the mat\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(UserError, match=r"3 parts for an input that makes at most 1 shards"):
        capture_on_ray(_job(small), tmp_path / "store", parts=3)
    with pytest.raises(UserError, match=r"needs Ray: pip install 'tl-core\[ray\]'"):
        capture_on_ray(_job(small), tmp_path / "store", parts=1)
    with pytest.raises(UserError, match="parts must be a whole number >= 1"):
        capture_on_ray(_job(small), tmp_path / "store", parts=0)
    (tmp_path / "store").mkdir()
    with pytest.raises(UserError, match="merges its parts into a new folder"):
        capture_on_ray(_job(small), tmp_path / "store", parts=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.txt", "store"]


def _lock_from(folder: Path, **fields: object) -> None:
    folder.mkdir(exist_ok=True)
    (folder / LOCK).write_text(json.dumps({"pid": 4242, "host": "elsewhere", **fields}))


def test_a_later_attempt_of_the_same_job_takes_the_lock_over_from_any_host(
    tmp_path: Path,
) -> None:
    _lock_from(tmp_path, job="ray job 1 part 0/2")
    with StoreLock(tmp_path, job="ray job 1 part 0/2") as lock:
        assert json.loads((tmp_path / LOCK).read_text())["job"] == "ray job 1 part 0/2"
        assert (
            "an earlier attempt of ray job 1 part 0/2 (process 4242 on elsewhere) died"
            in (lock.notes[0])
        )
    for job in ("ray job 2 part 0/2", None):  # another job's lock, or no job: judged by host
        _lock_from(tmp_path, job="ray job 1 part 0/2")
        with pytest.raises(UserError, match="locked by a capture on host 'elsewhere'"):
            StoreLock(tmp_path, job=job).acquire()


def test_a_part_asks_for_what_its_engine_needs() -> None:
    def job(driver: str, **options: object) -> CaptureConfig:
        return CaptureConfig(
            model="m", hooks=("x",), input="-", driver=driver, boot_options=options
        )

    assert (part_resources(job("native")).cpus, part_resources(job("native")).gpus) == (1, 0)
    assert part_resources(job("hf", device="cuda:0")).gpus == 1
    assert part_resources(job("vllm", tensor_parallel_size=2, pipeline_parallel_size=2)).gpus == 4
    ray_executor = job("vllm", tensor_parallel_size=2, distributed_executor_backend="ray")
    assert part_resources(ray_executor).gpus == 0  # vLLM places its own workers
    assert part_resources(job("native"), cpus=4, gpus=0.5).options() == {
        "num_cpus": 4.0,
        "num_gpus": 0.5,
    }
    with pytest.raises(UserError, match="part resources must be >= 0"):
        part_resources(job("native"), cpus=-1)


def test_merge_without_verify_reads_no_checksum_but_still_checks_each_entry(
    tmp_path: Path, write_documents: Callable[..., Path]
) -> None:
    source = write_documents(tmp_path / "docs.txt", n=30)
    parts = [tmp_path / f"part-{i}" for i in range(2)]
    for i, folder in enumerate(parts):
        capture(_job(source), folder, part=(i, 2), progress=False)
    shard = parts[1] / "shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # one activation byte: size and header unchanged
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="shard 1"):
        merge_stores(parts, tmp_path / "verified")
    merged = merge_stores(parts, tmp_path / "trusted", verify=False)
    assert len(merged.shards) == merged.total_shards
    shard.write_bytes(bytes(data[:-1]))  # a truncated shard is refused either way
    with pytest.raises(UserError, match="shard 1"):
        merge_stores(parts, tmp_path / "truncated", verify=False)


def test_nothing_imports_ray_unless_a_job_asks_for_a_cluster() -> None:
    import subprocess

    code = (
        "import sys, tl_core, tl_core.capture, tl_core.cli;"
        "from tl_core.capture import capture_on_ray, ClusterSummary;"
        "import tl_core.capture._cluster, tl_core.capture._on_ray;"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
