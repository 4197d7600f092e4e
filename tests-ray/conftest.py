"""A Ray cluster simulated on this machine: two Ray nodes, every one on the loopback address.

Ray takes its node address from the machine's network interface unless this switch says
otherwise; it must be set before Ray is imported, in this process and in every process a
test starts (the ``tl`` command included), so no test sends traffic to another address.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback node addresses

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

#: Ray's processes, by the names they run under.
_RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "dashboard", "runtime_env", "log_monitor")


def descendants(root: int) -> dict[int, str]:
    """Live processes below ``root``: pid -> command line."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    below: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in below:
                below[pid] = commands.get(pid, "")
                frontier.append(pid)
    return below


def ray_processes(root: int) -> dict[int, str]:
    """Ray's processes below ``root``."""
    return {
        pid: command
        for pid, command in descendants(root).items()
        if any(name in command for name in _RAY_PROCESSES)
    }


def listening(pids: set[int]) -> list[str]:
    """The local addresses of the TCP sockets that processes ``pids`` listen on."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            links = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_address(fields[1].split(":")[0], width))
    return found


def _address(hex_address: str, width: int) -> str:
    """``/proc/net/tcp*``'s hexadecimal address as text (IPv4, or IPv6 as its words)."""
    raw = bytes.fromhex(hex_address)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # host-order 32-bit words
    joined = b"".join(words)
    if width == 8:
        return ".".join(str(b) for b in joined)
    if joined[:12] == b"\0" * 10 + b"\xff\xff":
        return "::ffff:" + ".".join(str(b) for b in joined[12:])
    return joined.hex()


def is_loopback(address: str) -> bool:
    return address.startswith(("127.", "::ffff:127.")) or address == "0" * 31 + "1"


def start_cluster(cpus: tuple[int, ...] = (2, 2)) -> Cluster:
    """A head and worker nodes with these CPUs, all on 127.0.0.1."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": cpus[0],
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    for count in cpus[1:]:
        cluster.add_node(num_cpus=count, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    return cluster


def stop_cluster(cluster: Cluster, before: set[int]) -> None:
    """Shut ``cluster`` down and check that every Ray process started since ``before`` (the
    Ray processes there were) is gone."""
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()

    def left() -> dict[int, str]:
        return {p: c for p, c in ray_processes(os.getpid()).items() if p not in before}

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), f"Ray processes left running: {left()}"


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Two Ray nodes of 2 CPUs each on the loopback address, stopped after the session."""
    before = set(ray_processes(os.getpid()))
    started = start_cluster()
    try:
        yield started
    finally:
        stop_cluster(started, before)


#: The vocabulary of the generated documents.
WORDS = "the cat sat on a mat while dogs ran over hills and birds sang in old trees"


@pytest.fixture(scope="session")
def documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 short English-like documents, one per line (enough for parts that run seconds)."""
    rng = random.Random(0)
    words = WORDS.split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 60))) for _ in range(400)]
    path = tmp_path_factory.mktemp("input") / "docs.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def own_cluster() -> Iterator[Cluster]:
    """A head node of 2 CPUs of its own, for a test that adds nodes (stopped after it)."""
    before = set(ray_processes(os.getpid()))
    started = start_cluster((2,))
    try:
        yield started
    finally:
        stop_cluster(started, before)


@pytest.fixture
def ray_listening() -> Callable[[], list[str]]:
    """``ray_listening()``: the addresses Ray's processes under this test process listen on."""
    return lambda: listening(set(ray_processes(os.getpid())))


@pytest.fixture
def ray_pids() -> Callable[[], set[int]]:
    """``ray_pids()``: Ray's processes under this test process, now."""
    return lambda: set(ray_processes(os.getpid()))
