"""Capture jobs on a Ray cluster simulated on this machine.

A job run in parts as Ray tasks must write the store a single process writes, byte for byte
(every shard and the manifest), also when a part's worker is killed from outside mid-run;
bad input is refused before any engine boots.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ray.cluster_utils import Cluster

from tl_core import UserError
from tl_core.capture import CaptureConfig, capture, capture_on_ray
from tl_core.capture._lock import LOCK

HOOKS = ("blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.mlp.hook_post")


def native_job(source: Path, **changes: Any) -> CaptureConfig:
    fields: dict[str, Any] = {
        "model": "gpt2",
        "driver": "native",
        "boot_options": {"n_layers": 2, "seed": 3},
        "hooks": HOOKS,
        "input": str(source),
        "context_size": 24,
        "batch_size": 2,
        "shard_contexts": 4,
    }
    return CaptureConfig(**{**fields, **changes})


def cli_args(config: CaptureConfig, output: Path) -> list[str]:
    options = [f"{k}={v}" for k, v in config.boot_options.items()]
    return [
        "capture", "run", "--model", config.model, "--driver", config.driver,
        *(a for o in options for a in ("--option", o)), "--hooks", *config.hooks,
        "--input", config.input, "--output", str(output),
        "--context-size", str(config.context_size), "--batch-size", str(config.batch_size),
        "--shard-contexts", str(config.shard_contexts),
    ]  # fmt: skip


def same_files(got: Path, want: Path) -> None:
    """Every file of the two stores (shards and manifest) is byte-identical."""
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    assert len(names) > 10
    for name in names:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


@pytest.fixture(scope="module")
def reference(documents: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The native job, run in this process with no cluster."""
    out = tmp_path_factory.mktemp("reference") / "store"
    capture(native_job(documents), out, progress=False)
    return out


def tl_command(*args: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        "import sys; from tl_core.cli import main; sys.exit(main())",
        *args,
    ]


def test_four_parts_on_the_cluster_write_the_single_process_store(
    cluster: Cluster,
    documents: Path,
    reference: Path,
    tmp_path: Path,
    ray_listening: Any,
) -> None:
    out = tmp_path / "store"
    done = subprocess.run(
        tl_command(*cli_args(native_job(documents), out), "--ray", cluster.address, "--parts", "4"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    same_files(out, reference)
    assert "4 parts on Ray merged" in done.stdout and "0 retried" in done.stdout
    for part in range(4):
        assert f"ray capture: part {part}/4 complete" in done.stderr
    assert not (tmp_path / "store.parts").exists()  # merged, then removed
    # Every socket the cluster listens on is a loopback one.
    addresses = ray_listening()
    assert addresses and all(a.startswith(("127.", "::ffff:127.")) for a in addresses), addresses


def test_two_parts_on_the_hf_driver_write_the_single_process_store(
    cluster: Cluster, documents: Path, tmp_path: Path
) -> None:
    from tl_driver_hf.testing import write_tiny_checkpoint

    folder = write_tiny_checkpoint("llama", tmp_path / "llama")
    config = CaptureConfig(
        model=str(folder),
        driver="hf",
        boot_options={"dtype": "float32"},
        hooks=("blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"),
        input=str(documents),
        context_size=32,
        batch_size=4,
        shard_contexts=8,
        max_tokens=6000,
    )
    capture(config, tmp_path / "single", progress=False)
    summary = capture_on_ray(
        config, tmp_path / "merged", parts=2, address=cluster.address, progress=False
    )
    assert summary.parts == 2 and summary.retries == 0
    assert summary.shards == len(list((tmp_path / "single").glob("shard-*")))
    same_files(tmp_path / "merged", tmp_path / "single")


def test_without_an_address_a_loopback_cluster_runs_the_job_and_is_stopped(
    cluster: Cluster,
    documents: Path,
    reference: Path,
    tmp_path: Path,
    ray_pids: Callable[[], set[int]],
) -> None:
    """A cluster of its own, although another runs on this machine (the session's)."""
    before = ray_pids()
    summary = capture_on_ray(native_job(documents), tmp_path / "store", parts=2, progress=False)
    assert summary.parts == 2
    same_files(tmp_path / "store", reference)
    deadline = time.monotonic() + 30
    while ray_pids() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_pids() - before, "the job's own cluster was stopped"


def test_a_killed_worker_is_retried_and_the_store_is_the_same(
    cluster: Cluster, documents: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    log = tmp_path / "progress.log"
    command = tl_command(
        *cli_args(native_job(documents), out), "--ray", cluster.address, "--parts", "2"
    )
    with log.open("w") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
        part = tmp_path / "store.parts" / "part-1-of-2"
        victim, deadline = None, time.monotonic() + 300
        while victim is None and time.monotonic() < deadline and process.poll() is None:
            manifest = part / "manifest.json"
            if manifest.exists() and manifest.read_text().count('"sha256"') >= 3:
                victim = _holder(part)
            time.sleep(0.01)
        assert victim is not None, "part 1 recorded no shards while the test watched"
        os.kill(victim, signal.SIGKILL)
        stdout, _ = process.communicate(timeout=600)
    printed = log.read_text()
    assert process.returncode == 0, printed
    assert "part 1/2 retried (attempt 2" in printed and "the worker of attempt 1 died" in printed
    assert "1 retried" in stdout
    same_files(out, reference)


def test_a_part_that_fails_stops_the_job_naming_the_part(
    cluster: Cluster, documents: Path, tmp_path: Path
) -> None:
    """An error only the booted model finds (a spec's hook it does not have) is the job's
    own: not retried, reported with the part, every part folder kept for the fixed rerun."""
    config = native_job(documents, intervene={"blocks.7.hook_out": {"op": "scale", "factor": 2.0}})
    with pytest.raises(UserError, match=r"part [01]/2: .*blocks\.7"):
        capture_on_ray(config, tmp_path / "store", parts=2, address=cluster.address, progress=False)
    assert not (tmp_path / "store").exists()
    attempts = sorted(
        p.name.split(".")[0] for p in (tmp_path / "store.parts" / ".attempts").iterdir()
    )
    assert len(attempts) == len(set(attempts)), f"a part was retried: {attempts}"


def _holder(store: Path) -> int | None:
    """The process id the store's lock names (``None`` while it is being written)."""
    try:
        return int(json.loads((store / LOCK).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def test_an_unreachable_address_is_refused_before_any_engine(
    documents: Path, tmp_path: Path
) -> None:
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    import ray

    with pytest.raises(UserError, match=rf"no Ray cluster answers at 127.0.0.1:{port}"):
        capture_on_ray(
            native_job(documents), tmp_path / "store", parts=2, address=f"127.0.0.1:{port}"
        )
    # Refused by the address check itself, not after Ray's own connection retries.
    assert not ray.is_initialized()
    assert not list(tmp_path.iterdir())
    with pytest.raises(UserError, match="is not host:port"):
        capture_on_ray(native_job(documents), tmp_path / "store", parts=2, address="nowhere")


def test_more_parts_than_contexts_are_refused_before_the_cluster(tmp_path: Path) -> None:
    small = tmp_path / "small.txt"
    small.write_text("the cat sat\non the mat\n")
    with pytest.raises(UserError, match=r"8 parts for an input that makes at most 1 shards"):
        capture_on_ray(native_job(small), tmp_path / "store", parts=8, address="127.0.0.1:1")
    assert not (tmp_path / "store.parts").exists()


def test_resources_no_node_has_are_refused_before_any_engine(
    cluster: Cluster, documents: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match=r"each part needs 1 CPU\(s\) and 1 GPU\(s\) on one node"):
        capture_on_ray(
            native_job(documents), tmp_path / "store", parts=2, address=cluster.address, part_gpus=1
        )
    with pytest.raises(UserError, match=r"127\.0\.0\.1 \(.*\): 2 CPU\(s\), 0 GPU\(s\)"):
        capture_on_ray(
            native_job(documents), tmp_path / "store", parts=2, address=cluster.address, part_cpus=3
        )
    assert not (tmp_path / "store.parts").exists()


def test_bad_cli_combinations_are_refused(
    documents: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tl_core.cli import main

    base = cli_args(native_job(documents), tmp_path / "store")
    for extra, message in (
        (["--parts", "2"], "add --ray"),
        (["--ray"], "--ray needs --parts N"),
        (["--ray", "--parts", "2", "--shard", "1/2"], "--shard does not combine with --ray"),
        (["--ray", "--parts", "0"], "parts must be a whole number >= 1"),
    ):
        assert main([*base, *extra]) != 0
        assert message in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


#: A Ray worker node that cannot see the job's folder: started in its own mount namespace,
#: with an empty file system mounted over the folder the job writes in.
BLIND_NODE = """
import os, signal, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
from ray._private.node import Node
from ray._private.parameter import RayParams
params = RayParams(node_ip_address="127.0.0.1", gcs_address=sys.argv[1], num_cpus=1, num_gpus=0,
                   object_store_memory=150 * 2**20, min_worker_port=0, max_worker_port=0,
                   include_log_monitor=False, node_manager_port=0)
params.dashboard_agent_listen_port = None
node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
print("ready", flush=True)
signal.sigwait({signal.SIGTERM})
node.kill_all_processes(check_alive=False, allow_graceful=True)
"""


def test_a_node_that_cannot_see_the_folder_is_named_before_any_engine(
    own_cluster: Cluster, documents: Path, tmp_path: Path
) -> None:
    import shutil

    if shutil.which("unshare") is None:
        pytest.fail("this test needs util-linux's unshare (a node in its own mount namespace)")
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    namespace = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = f"mount -t tmpfs tl-blind {jobs} && exec {sys.executable} -c '{BLIND_NODE}' {own_cluster.address}"
    node = subprocess.Popen(
        [*namespace, "sh", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert node.stdout is not None and node.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while len([n for n in _alive_nodes(own_cluster)]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(
            UserError, match=r"(?s)every node that runs a part must reach.*cannot read"
        ):
            capture_on_ray(
                native_job(documents), jobs / "store", parts=2, address=own_cluster.address
            )
        assert not (jobs / "store.parts").exists()
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=60)


def _alive_nodes(cluster: Cluster) -> list[dict[str, Any]]:
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        return [n for n in ray.nodes() if n["Alive"]]
    finally:
        ray.shutdown()


# -- joining a cluster: a loopback address works, and nothing waits without a bound -------


def _without_switch() -> dict[str, str]:
    """This process's environment without Ray's loopback switch (as a user's shell has it)."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}


def test_a_loopback_cluster_is_joined_without_the_switch_set(
    cluster: Cluster, documents: Path, reference: Path, tmp_path: Path
) -> None:
    """Ray redirects a loopback address to the machine's network address unless its switch
    is set; tl sets it for a loopback address (before this, the job waited forever)."""
    out = tmp_path / "store"
    done = subprocess.run(
        tl_command(*cli_args(native_job(documents), out), "--ray", cluster.address, "--parts", "2"),
        env=_without_switch(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    same_files(out, reference)


def test_a_loopback_address_ray_would_redirect_is_refused_at_once(
    cluster: Cluster, documents: Path, reference: Path, tmp_path: Path
) -> None:
    """With the switch set the other way before tl runs, Ray would look for the cluster on
    the machine's network address: the job stops at once, saying so."""
    from ray._private.services import node_ip_address_from_perspective

    out = tmp_path / "store"
    done = subprocess.run(
        tl_command(*cli_args(native_job(documents), out), "--ray", cluster.address, "--parts", "2"),
        env={**_without_switch(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    network = node_ip_address_from_perspective()
    if network.startswith("127."):  # a machine with no network address: nothing to redirect to
        assert done.returncode == 0, done.stderr[-3000:]
        same_files(out, reference)
        return
    assert done.returncode == 1, done.stderr[-3000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith(f"tl: error: Ray would join the loopback address {cluster.address}")
    assert f"through this machine's network address {network}:" in error
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in error and not out.exists()


def test_a_head_that_never_answers_is_given_up_after_the_connect_timeout(
    documents: Path, tmp_path: Path, ray_pids: Callable[[], set[int]]
) -> None:
    """A port that accepts connections but speaks no Ray (ray.init alone retries it for
    many minutes)."""
    import socket

    before = ray_pids()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        done = subprocess.run(
            tl_command(
                *cli_args(native_job(documents), tmp_path / "store"),
                *("--ray", address, "--parts", "2", "--connect-timeout", "3"),
            ),
            capture_output=True,
            text=True,
            timeout=120,  # Ray's own retries would run far past this
        )
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        f"tl: error: the Ray cluster at {address} did not accept this job within 3 s" in done.stderr
    )
    assert "Traceback" not in done.stderr and not (tmp_path / "store").exists()
    assert ray_pids() == before
