"""A Ray cluster for a capture job: connect to one (or start one on this machine) and check,
before any engine boots, that it can run the job's parts.

Ray is imported only here and in the modules that run parts, and only when a job asks for
a cluster: it is the optional extra ``tl-core[ray]``.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tl_core._errors import UserError
from tl_core.capture._config import CaptureConfig

__all__ = [
    "LOOPBACK_ONLY",
    "PartResources",
    "check_reachable",
    "connect",
    "import_ray",
    "nodes_for",
    "part_resources",
]

#: Ray's switch that makes it use the loopback address as this machine's node address
#: (otherwise a local cluster listens on the machine's network interface). A cluster tl
#: starts for one job sets it (before Ray is imported); tests set it for every node.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

_INSTALL = "pip install 'tl-core[ray]'"


def import_ray(*, local: bool = False) -> Any:
    """Ray, or a ``UserError`` saying how to install it.

    Args:
        local: Ray will start a cluster on this machine: make it listen on the loopback
            address only (takes effect when Ray is not imported yet).
    """
    if local and "ray" not in sys.modules:
        for key, value in LOOPBACK_ONLY.items():
            os.environ.setdefault(key, value)
    try:
        import ray
    except ImportError:
        raise UserError(f"running a capture on a Ray cluster needs Ray: {_INSTALL}") from None
    return ray


@dataclass(frozen=True)
class PartResources:
    """What one part of a job asks Ray for: CPUs and GPUs, all on one node."""

    cpus: float
    gpus: float

    def options(self) -> dict[str, float]:
        """Ray's task options for these resources."""
        return {"num_cpus": self.cpus, "num_gpus": self.gpus}

    def __str__(self) -> str:
        return f"{self.cpus:g} CPU(s) and {self.gpus:g} GPU(s)"


def part_resources(
    config: CaptureConfig, *, cpus: float | None = None, gpus: float | None = None
) -> PartResources:
    """The resources one part's engine needs, unless given.

    A vLLM part holds ``tensor_parallel_size * pipeline_parallel_size`` GPUs (none when
    vLLM places its own workers with ``distributed_executor_backend="ray"``); an hf part
    on a CUDA device one GPU; anything else none. Every part holds one CPU.
    """
    options = config.boot_options
    if gpus is None:
        gpus = 0.0
        if config.driver == "vllm" and options.get("distributed_executor_backend") != "ray":
            gpus = float(
                int(options.get("tensor_parallel_size", 1))
                * int(options.get("pipeline_parallel_size", 1))
            )
        elif str(options.get("device", "cpu")).startswith("cuda"):
            gpus = 1.0
    if cpus is None:
        cpus = 1.0
    if cpus < 0 or gpus < 0:
        raise UserError(f"part resources must be >= 0, got {cpus:g} CPU(s) and {gpus:g} GPU(s)")
    return PartResources(cpus=float(cpus), gpus=float(gpus))


def _check_address(address: str) -> None:
    """Refuse a ``host:port`` no Ray head answers on, quickly and by name."""
    target = address.removeprefix("ray://")
    host, colon, port_text = target.rpartition(":")
    if not colon or not port_text.isdigit():
        raise UserError(
            f"Ray address {address!r} is not host:port (e.g. 127.0.0.1:6379, the address "
            f"`ray start --head` prints), 'auto' (the cluster this machine belongs to) or "
            f"ray://host:port"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port_text)), timeout=5):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise UserError(
            f"no Ray cluster answers at {address} ({reason}); start one (`ray start --head`), "
            f"or check the head's address and port, then rerun"
        ) from None


def connect(ray: ModuleType, address: str | None) -> Callable[[], None]:
    """Connect to the Ray cluster at ``address``, or start one on this machine when it is
    ``None`` (listening on the loopback address only, with this machine's CPUs).

    Returns:
        What to call when the job ends: it stops a cluster started here, or disconnects.

    Raises:
        UserError: No cluster answers at ``address``.
    """
    if ray.is_initialized():
        return lambda: None  # the caller's own connection stays theirs
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": "WARNING"}
    if address is None:  # "local": a new instance, never one found on this machine
        ray.init(address="local", include_dashboard=False, **quiet)
        return _disconnect(ray)
    if address != "auto":
        _check_address(address)
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError) as error:
        raise UserError(f"cannot join the Ray cluster at {address}: {error}") from None
    return _disconnect(ray)


def _disconnect(ray: ModuleType) -> Callable[[], None]:
    def disconnect() -> None:
        ray.shutdown()

    return disconnect


def _describe(node: Mapping[str, Any]) -> str:
    resources = node.get("Resources", {})
    return (
        f"{node.get('NodeManagerAddress', '?')} ({node.get('NodeManagerHostname', '?')}): "
        f"{resources.get('CPU', 0):g} CPU(s), {resources.get('GPU', 0):g} GPU(s)"
    )


def nodes_for(ray: ModuleType, need: PartResources) -> list[dict[str, Any]]:
    """The cluster's live nodes that can run one part.

    Raises:
        UserError: No node has the CPUs and GPUs a part needs (each node named with what it has).
    """
    alive = [n for n in ray.nodes() if n.get("Alive")]
    able = [
        n
        for n in alive
        if n["Resources"].get("CPU", 0) >= need.cpus and n["Resources"].get("GPU", 0) >= need.gpus
    ]
    if not able:
        shown = "; ".join(_describe(n) for n in alive) or "none"
        raise UserError(
            f"no node of the Ray cluster can run a part: each part needs {need} on one node, "
            f"and the live nodes have: {shown}. Add such a node, or lower what a part asks "
            f"for (--part-cpus, --part-gpus; a vLLM part holds tensor_parallel_size x "
            f"pipeline_parallel_size GPUs)"
        )
    return able


def _probe(root: str, token: str) -> tuple[str, str | None]:
    """On one node: this host's name, and why the job's folder is unusable here (or ``None``)."""
    host = socket.gethostname()
    marker = Path(root) / f".tl-reach-{token}"
    try:
        seen = marker.read_text()
    except OSError as error:
        return host, f"cannot read {marker} ({error.strerror or error})"
    if seen != token:
        return host, f"{marker} holds other content: {root} here is another folder"
    probe = Path(root) / f".tl-reach-{token}-{os.getpid()}"
    try:
        probe.write_text(token)
        probe.unlink()
    except OSError as error:
        return host, f"cannot write in {root} ({error.strerror or error})"
    return host, None


def check_reachable(ray: ModuleType, nodes: Sequence[Mapping[str, Any]], root: Path) -> None:
    """Check that every node in ``nodes`` reads and writes the same folder ``root`` (a
    marker written here must be seen there), by a small task pinned to each node.

    Raises:
        UserError: Naming each node that cannot, and why.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    marker = root / f".tl-reach-{token}"
    marker.write_text(token)
    try:
        probe = ray.remote(_probe)
        calls = [
            probe.options(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
            ).remote(str(root), token)
            for n in nodes
        ]
        answers = ray.get(calls, timeout=120)
    finally:
        marker.unlink(missing_ok=True)
    problems = [
        f"node {n['NodeManagerAddress']} ({host}): {why}"
        for n, (host, why) in zip(nodes, answers, strict=True)
        if why is not None
    ]
    if problems:
        raise UserError(
            f"the job's parts write under {root}, which every node that runs a part must "
            f"reach as the same folder (a shared file system mounted at the same path), but:\n  "
            + "\n  ".join(problems)
            + "\nMount the folder on those nodes, or choose an output on a shared file system"
        )
