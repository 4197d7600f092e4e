"""``capture_on_ray``: a capture job's parts as Ray tasks, merged into one store.

Each part is one task that boots its own engine and writes its own part folder
(``<output>.parts/part-<i>-of-<N>``) exactly as ``tl capture run --shard i/N`` would. A
part whose worker dies is retried by Ray and resumes from its folder (the store's resume
rules make that exact). When every part is complete they are merged into ``output``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tl_core._errors import UserError
from tl_core.capture._cluster import (
    CONNECT_TIMEOUT,
    PartResources,
    check_reachable,
    connect,
    import_ray,
    nodes_for,
    part_resources,
)
from tl_core.capture._config import CaptureConfig
from tl_core.capture._contexts import most_contexts
from tl_core.capture._manifest import MANIFEST, Manifest
from tl_core.capture._merge import merge_stores
from tl_core.capture._preflight import preflight
from tl_core.capture._run import capture_attempt
from tl_core.capture._source import Document

__all__ = ["ClusterSummary", "capture_on_ray", "part_folders"]


@dataclass(frozen=True)
class ClusterSummary:
    """What one ``capture_on_ray`` call did.

    Attributes:
        store: The merged store.
        parts: How many parts the job ran in.
        retries: Attempts Ray started again after a part's worker died.
        shards: Shards in the merged store.
        rows: Stored positions in the merged store.
        tokens_written: Model input tokens the parts ran in this call.
        seconds: Wall time (the cluster's start included).
    """

    store: Path
    parts: int
    retries: int
    shards: int
    rows: int
    tokens_written: int
    seconds: float

    def __str__(self) -> str:
        rate = self.tokens_written / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{self.store}: {self.parts} parts on Ray merged, {self.shards} shards "
            f"({self.rows:,} rows); {self.tokens_written:,} tokens in {self.seconds:.1f} s "
            f"({rate:,.0f} tok/s), {self.retries} retried"
        )


def part_folders(output: Path, parts: int) -> list[Path]:
    """Where the parts of a job writing ``output`` keep their stores."""
    root = output.parent / f"{output.name}.parts"
    return [root / f"part-{i}-of-{parts}" for i in range(parts)]


#: The folder, next to the parts, where each attempt of a part leaves an empty file
#: ``part-<i>.<n>.<host>.<pid>`` (a second file of a part is a retry).
ATTEMPTS = ".attempts"


def _begin_attempt(root: Path, part: int) -> None:
    """Record that an attempt of ``part`` starts here (host and process in the file name)."""
    folder = root / ATTEMPTS
    folder.mkdir(exist_ok=True)
    number = sum(1 for _ in folder.glob(f"part-{part}.*")) + 1
    host = socket.gethostname().replace(".", "-")
    (folder / f"part-{part}.{number}.{host}.{os.getpid()}").touch()


def _attempts(root: Path) -> dict[int, list[str]]:
    """Part -> where each of its attempts ran, in order."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for path in (root / ATTEMPTS).glob("part-*"):
        part, number, host, pid = path.name.removeprefix("part-").split(".")
        seen.setdefault(int(part), []).append((int(number), f"{host} pid {pid}"))
    return {part: [where for _, where in sorted(runs)] for part, runs in seen.items()}


def _run_part(
    config: CaptureConfig, folder: str, part: int, parts: int, job: str, model: dict[str, Any]
) -> None:
    """One part, on a Ray worker: its folder must be the shared one the driver checked, and
    its model files the ones ``model`` records (hashed where the job was submitted)."""
    if not Path(folder).parent.is_dir():
        raise UserError(
            f"part {part}/{parts} runs on {socket.gethostname()}, which cannot see "
            f"{Path(folder).parent}: every node must mount the job's folder at the same path"
        )
    _begin_attempt(Path(folder).parent, part)
    capture_attempt(
        config,
        folder,
        part=(part, parts),
        repair=False,
        progress=False,
        bridge=None,
        job=f"{job} part {part}/{parts}",
        expected_model=model,
    )
    # Every shard's checksum, read back here: the parts verify in parallel, on their own
    # nodes, what the merge would otherwise read again in one process.
    Manifest.load(Path(folder)).check_shards(Path(folder), checksum=True)


class _ClusterProgress:
    """Prints each part's end and each retry as it happens, and a status line (tokens summed
    over parts, counted as each shard is recorded) every ``interval`` seconds."""

    def __init__(self, folders: Sequence[Path], stream: TextIO, interval: float) -> None:
        self.folders, self.stream, self.interval = list(folders), stream, interval
        self.start = time.perf_counter()
        self._last = self.start
        self.before = sum(self._tokens(f) for f in self.folders)
        self.retries = 0
        self._seen: dict[int, int] = {}

    @staticmethod
    def _tokens(folder: Path) -> int:
        try:
            shards = json.loads((folder / MANIFEST).read_text())["shards"]
        except (OSError, ValueError, KeyError):
            return 0  # no manifest yet, or one being replaced this moment
        return sum(int(s.get("tokens", 0)) for s in shards)

    def tokens(self) -> int:
        return sum(self._tokens(f) for f in self.folders) - self.before

    def say(self, text: str) -> None:
        self.stream.write(f"ray capture: {text}\n")
        self.stream.flush()

    def attempts(self, seen: dict[int, list[str]], show: bool) -> None:
        for part, where in sorted(seen.items()):
            for attempt in range(self._seen.get(part, 1), len(where)):
                self.retries += 1
                if show:
                    self.say(
                        f"part {part}/{len(self.folders)} retried (attempt {attempt + 1}, on "
                        f"{where[attempt]}): the worker of attempt {attempt} died; it "
                        f"resumes from {self.folders[part]}"
                    )
            self._seen[part] = max(self._seen.get(part, 1), len(where))

    def tick(self, done: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        tokens = self.tokens()
        rate = tokens / max(now - self.start, 1e-9)
        self.say(
            f"{done}/{len(self.folders)} parts done, {tokens:,} tokens, {rate:,.0f} tok/s, "
            f"{self.retries} retried"
        )


def capture_on_ray(
    config: CaptureConfig,
    output: str | Path,
    *,
    parts: int,
    address: str | None = None,
    part_cpus: float | None = None,
    part_gpus: float | None = None,
    max_retries: int = 3,
    connect_timeout: float | None = None,
    keep_parts: bool = False,
    progress: bool = True,
    progress_interval: float = 5.0,
    stream: TextIO | None = None,
) -> ClusterSummary:
    """Run ``config`` in ``parts`` parts on a Ray cluster and merge them into ``output``.

    Every check that needs no engine runs first, here: the job's own checks (as
    ``capture`` makes them) for every part's folder, that the input makes at least
    ``parts`` contexts, that the cluster answers, that a node has what a part needs, and
    that every such node sees the job's folder. Rerunning the same call after an
    interruption resumes every part from its folder.

    Args:
        config: The job.
        output: A new folder for the merged store; the parts write next to it, in
            ``<output>.parts/``, which must be on a file system every node mounts at the
            same path.
        parts: How many parts (Ray tasks, each with its own engine).
        address: A running cluster's address (``host:port``, ``auto`` or
            ``ray://host:port``); ``None`` starts a cluster on this machine for the job,
            listening on the loopback address only. If this process is already connected
            to Ray, that connection is used.
        part_cpus: CPUs a part holds (default 1).
        part_gpus: GPUs a part holds (default: what its engine needs, see
            ``part_resources``).
        max_retries: How often Ray starts a part again after its worker died.
        connect_timeout: Seconds joining the cluster at ``address`` may take (default
            60); then the job stops with the reason (``ray.init`` itself retries for many
            minutes). Only with an ``address``: a cluster started here is not joined.
        keep_parts: Keep the part folders after the merge (their shards are hard links
            into the merged store where the file system allows, so they cost no space).
        progress: Print each retry and finished part, and a status line, on ``stream``.
        progress_interval: Seconds between status lines.
        stream: Where progress goes (default stderr).

    Returns:
        What the job did.

    Raises:
        UserError: Bad options, an existing output, an input too small for ``parts``, no
            cluster at ``address`` (or none that accepts the job within
            ``connect_timeout``), no node that can run a part, a node that cannot see the
            job's folder, a node that reads other model files at the model's path, or a
            part that failed (its error, with the part and node named).
    """
    started = time.perf_counter()
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise UserError(f"parts must be a whole number >= 1, got {parts!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise UserError(
            f"max_retries (--max-retries) must be a whole number >= 0, got {max_retries!r}"
        )
    if connect_timeout is not None and address is None:
        raise UserError(
            f"connect_timeout={connect_timeout!r} (--connect-timeout) bounds joining a running "
            f"cluster at an address, but no address is given: the job starts its own cluster "
            f"here, so it would be ignored; pass address=, or drop connect_timeout"
        )
    timeout = CONNECT_TIMEOUT if connect_timeout is None else connect_timeout
    for name, value in (("connect_timeout", timeout), ("progress_interval", progress_interval)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise UserError(f"{name} must be a number of seconds > 0, got {value!r}")
    for name, given in (("part_cpus", part_cpus), ("part_gpus", part_gpus)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, (int, float))):
            raise UserError(f"{name} must be a number (or None for the default), got {given!r}")
    if address is not None and not isinstance(address, str):
        raise UserError(f"address must be 'host:port', 'auto' or None, got {address!r}")
    output = Path(output).absolute()
    if output.exists():
        raise UserError(
            f"{output} exists; a capture on Ray merges its parts into a new folder: remove it "
            f"or choose another output"
        )
    folders = part_folders(output, parts)
    checked = preflight(config, [(f, (i, parts)) for i, f in enumerate(folders)])
    _check_parts(config, checked.source, parts)
    need = part_resources(config, cpus=part_cpus, gpus=part_gpus)
    ray = import_ray(local=address is None, address=address)
    disconnect = connect(ray, address, timeout)
    root = folders[0].parent
    created = not root.exists()
    try:
        nodes = nodes_for(ray, need)
        root.mkdir(parents=True, exist_ok=True)
        try:
            check_reachable(ray, nodes, root)
        except UserError:
            if created:
                root.rmdir()  # nothing was written in it
            raise
        display = _ClusterProgress(
            folders, stream if stream is not None else sys.stderr, progress_interval
        )
        tokens = _run_parts(
            ray, config, folders, need, max_retries, display, progress, checked.model
        )
        merged = merge_stores(folders, output, verify=False)  # each part verified its own
    finally:
        disconnect()
    if not keep_parts:
        shutil.rmtree(root, ignore_errors=True)
    return ClusterSummary(
        store=output,
        parts=parts,
        retries=display.retries,
        shards=len(merged.shards),
        rows=merged.rows,
        tokens_written=tokens,
        seconds=time.perf_counter() - started,
    )


def _check_parts(config: CaptureConfig, documents: Iterable[Document], parts: int) -> None:
    most = most_contexts(documents, config)
    shards = -(-most // config.shard_contexts) if config.shard_contexts else most
    if parts > shards:
        unit = (
            f"shards of {config.shard_contexts} contexts" if config.shard_contexts else "contexts"
        )
        raise UserError(
            f"{parts} parts for an input that makes at most {shards} {unit} (context_size "
            f"{config.context_size}): a part computes whole shards, so some parts would boot "
            f"an engine for nothing; use {max(shards, 1)} parts or fewer"
        )


def _run_parts(
    ray: Any,
    config: CaptureConfig,
    folders: Sequence[Path],
    need: PartResources,
    max_retries: int,
    display: _ClusterProgress,
    progress: bool,
    model: dict[str, Any],
) -> int:
    """Submit the parts, show progress until all end; returns the tokens they ran."""
    task = ray.remote(_run_part).options(
        max_retries=max_retries, retry_exceptions=False, **need.options()
    )
    job = f"ray job {uuid.uuid4().hex[:12]}"
    shutil.rmtree(folders[0].parent / ATTEMPTS, ignore_errors=True)  # an earlier run's
    pending = {
        task.remote(config, str(folder), i, len(folders), job, model): i
        for i, folder in enumerate(folders)
    }
    done = 0
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            display.attempts(_attempts(folders[0].parent), show=progress)
            for ref in ready:
                part = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception as error:
                    raise _part_error(error, part, len(folders), max_retries) from None
                done += 1
                if progress:
                    display.say(f"part {part}/{len(folders)} complete")
            if progress:
                display.tick(done, force=bool(ready) and not pending)
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
    return display.tokens()


def _part_error(error: Exception, part: int, parts: int, max_retries: int) -> UserError:
    """A part's failure as a ``UserError`` naming the part (its own message kept)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, UserError):
        return UserError(f"part {part}/{parts}: {cause}")
    name = type(error).__name__
    if "WorkerCrashed" in name or "NodeDied" in name or "Unreachable" in name:
        return UserError(
            f"part {part}/{parts} lost its worker {max_retries + 1} time(s) ({name}); every "
            f"shard it recorded is kept: rerun the same command to resume it"
        )
    return UserError(f"part {part}/{parts} failed: {name}: {cause or error}")
