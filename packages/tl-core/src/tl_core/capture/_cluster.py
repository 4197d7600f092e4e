"""A Ray cluster for a capture job: connect to one (or start one on this machine) and check,
before any engine boots, that it can run the job's parts.

Ray is imported only here and in the modules that run parts, and only when a job asks for
a cluster: it is the optional extra ``tl-core[ray]``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tl_core._errors import UserError
from tl_core.capture._config import CaptureConfig

__all__ = [
    "CONNECT_TIMEOUT",
    "LOOPBACK_ONLY",
    "PartResources",
    "check_reachable",
    "connect",
    "import_ray",
    "is_loopback",
    "nodes_for",
    "part_resources",
]

#: Ray's switch that makes it use the loopback address as this machine's node address
#: (otherwise a local cluster listens on the machine's network interface, and Ray joins
#: a loopback address through that interface). A cluster tl starts for one job sets it,
#: and so does a job that joins a cluster at a loopback address (before Ray is imported);
#: tests set it for every node.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_SWITCH = next(iter(LOOPBACK_ONLY))

#: Seconds joining a running cluster may take before the job stops (``connect_timeout``).
CONNECT_TIMEOUT = 60.0

_INSTALL = "pip install 'tl-core[ray]'"


def _host_port(address: str) -> tuple[str, str] | None:
    """``host:port`` (or ``ray://host:port``) split, or ``None`` for another form."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    return (host.strip("[]"), port) if colon and port.isdigit() else None


def is_loopback(address: str) -> bool:
    """Whether ``address`` (``host:port``) names this machine's loopback interface."""
    split = _host_port(address)
    if split is None:
        return False
    try:
        return ipaddress.ip_address(split[0]).is_loopback
    except ValueError:
        return split[0] == "localhost"


def import_ray(*, local: bool = False, address: str | None = None) -> Any:
    """Ray, or a ``UserError`` saying how to install it.

    Args:
        local: Ray will start a cluster on this machine: make it listen on the loopback
            address only (takes effect when Ray is not imported yet).
        address: The cluster the job joins: at a loopback address Ray must stay on the
            loopback interface to reach it, so the same switch is set (it changes nothing
            else for a driver, and a cluster on the network interface still accepts it).
    """
    loopback = local or (address is not None and is_loopback(address))
    if loopback and "ray" not in sys.modules:
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
    split = _host_port(address)
    if split is None:
        raise UserError(
            f"Ray address {address!r} is not host:port (e.g. 127.0.0.1:6379, the address "
            f"`ray start --head` prints), 'auto' (the cluster this machine belongs to) or "
            f"ray://host:port"
        )
    try:
        with socket.create_connection((split[0], int(split[1])), timeout=5):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise UserError(
            f"no Ray cluster answers at {address} ({reason}); start one (`ray start --head`), "
            f"or check the head's address and port, then rerun"
        ) from None


def _check_redirect(address: str) -> None:
    """Refuse, at once, a loopback address Ray would join through this machine's network
    interface where nothing answers (Ray was imported before the switch could be set).

    Ray replaces a loopback host by the machine's interface address unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` was set when it was imported; a cluster that
    listens on the loopback address only is then never reached, and ``ray.init`` retries
    for many minutes without a word. The helpers read here are Ray's own; on a Ray
    without them the connect timeout still bounds the wait.
    """
    split = _host_port(address)
    if split is None or not is_loopback(address):
        return
    try:
        from ray._private import ray_constants, services

        if not ray_constants.ENABLE_RAY_CLUSTER:
            return
        target = str(services.resolve_ip_for_localhost(split[0]))
    except Exception:  # another Ray version: the timeout in connect() still holds
        return
    if target == split[0]:
        return
    try:
        with socket.create_connection((target, int(split[1])), timeout=5):
            return
    except OSError:
        pass
    raise UserError(
        f"Ray would join the loopback address {address} through this machine's network "
        f"address {target}:{split[1]}, where no cluster answers (the cluster listens on the "
        f"loopback address only). Ray keeps a loopback address only when {_SWITCH}=0 is set "
        f"before Ray is imported; tl sets it when it imports Ray, but this process imported "
        f"Ray with {_SWITCH}={os.environ.get(_SWITCH)!r}. Set {_SWITCH}=0 before Ray is "
        f"imported (or leave it unset and let tl import Ray), or start the cluster on the "
        f"machine's network address"
    )


class _QuietThreadWarning(logging.Filter):
    """Drops Ray's warning that ``ray.init`` outside the main thread sets no SIGTERM
    handler (``connect`` installs the same handler itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def _join_within(ray: ModuleType, address: str, timeout: float, options: dict[str, Any]) -> None:
    """``ray.init(address=...)``, given up after ``timeout`` seconds.

    ``ray.init`` has no timeout of its own and retries an unreachable head for many
    minutes, so it runs on a daemon thread that is left behind (and ends with the process)
    when the bound passes.
    """
    outcome: dict[str, BaseException] = {}
    done = threading.Event()

    def join() -> None:
        try:
            ray.init(address=address, **options)
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error
        finally:
            done.set()

    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # What ray.init does in the main thread: SIGTERM exits, so Ray's exit hooks run.
        signal.signal(signal.SIGTERM, lambda number, _frame: sys.exit(number))
    quiet = _QuietThreadWarning()
    worker_log = logging.getLogger("ray._private.worker")
    worker_log.addFilter(quiet)
    try:
        threading.Thread(target=join, name="tl-ray-connect", daemon=True).start()
        finished = done.wait(timeout)
    finally:
        worker_log.removeFilter(quiet)
    if not finished:
        redirected = address == "auto" or is_loopback(address)
        hint = (
            f" Ray joins a loopback address through the machine's network address unless "
            f"{_SWITCH}=0 was set before Ray was imported (here: {os.environ.get(_SWITCH)!r})."
            if redirected and os.environ.get(_SWITCH) != "0"
            else ""
        )
        raise UserError(
            f"the Ray cluster at {address} did not accept this job within {timeout:g} s "
            f"(connect_timeout, --connect-timeout); Ray's own log lines say what it kept "
            f"retrying.{hint} Check that the address is the one `ray start --head` printed, "
            f"that the head is up, and that it runs this Ray version ({ray.__version__}); "
            f"nothing was started"
        )
    error = outcome.get("error")
    if isinstance(error, (ConnectionError, RuntimeError)):
        raise UserError(f"cannot join the Ray cluster at {address}: {error}") from None
    if error is not None:
        raise error


def connect(
    ray: ModuleType, address: str | None, timeout: float = CONNECT_TIMEOUT
) -> Callable[[], None]:
    """Connect to the Ray cluster at ``address``, or start one on this machine when it is
    ``None`` (listening on the loopback address only, with this machine's CPUs).

    Args:
        ray: The Ray module (``import_ray``).
        address: ``host:port``, ``ray://host:port``, ``auto`` or ``None``.
        timeout: Seconds joining a running cluster may take.

    Returns:
        What to call when the job ends: it stops a cluster started here, or disconnects.

    Raises:
        UserError: No cluster answers at ``address``, Ray would join a loopback address
            where nothing answers, or the cluster did not accept the job within ``timeout``.
    """
    if ray.is_initialized():
        return lambda: None  # the caller's own connection stays theirs
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": "WARNING"}
    if address is None:  # "local": a new instance, never one found on this machine
        ray.init(address="local", include_dashboard=False, **quiet)
        return _disconnect(ray)
    if address != "auto":
        _check_address(address)
        _check_redirect(address)
    _join_within(ray, address, timeout, quiet)
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
