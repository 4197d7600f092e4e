"""``capture``: run a job's contexts through a bridge and write the store, resumably.

The contexts are cut into shards of ``shard_contexts``; each shard is computed in whole
batches and handed to a writer thread, which writes it atomically and then records it in
the manifest. The model computes the next shard meanwhile. A rerun skips recorded shards,
and a part of a sharded job (``part=(i, N)``) computes only shards ``i, i + N, ...``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tl_core._errors import UserError
from tl_core.capture._config import CaptureConfig
from tl_core.capture._contexts import Context, Tokens, contexts
from tl_core.capture._job import (
    HookPlan,
    identity,
    open_store,
    plan_hooks,
    shard_contexts,
    stop_layer,
)
from tl_core.capture._lock import StoreLock
from tl_core.capture._manifest import FORMAT, MANIFEST, Manifest
from tl_core.capture._progress import Progress
from tl_core.capture._shards import write_shard
from tl_core.capture._source import DocumentSource, open_source

__all__ = ["CaptureSummary", "capture", "parse_part"]


@dataclass(frozen=True)
class CaptureSummary:
    """What one ``capture`` call did.

    Attributes:
        store: The store folder.
        shards_written: Shards this run wrote.
        shards_before: Shards of this part already complete when it started.
        rows_written: Stored positions this run wrote.
        tokens_written: Model input tokens this run ran.
        seconds: Wall time of the run (boot included).
        complete: Whether this part of the job is now complete.
        notes: What was found and done on the way (leftovers of an interrupted run, repairs).
    """

    store: Path
    shards_written: int
    shards_before: int
    rows_written: int
    tokens_written: int
    seconds: float
    complete: bool
    notes: tuple[str, ...]

    def __str__(self) -> str:
        state = "complete" if self.complete else "incomplete"
        rate = self.tokens_written / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{self.store}: {self.shards_written} shards written ({self.rows_written:,} rows, "
            f"{self.tokens_written:,} tokens, {rate:,.0f} tok/s), {self.shards_before} already "
            f"there; the store is {state}"
        )


def parse_part(text: str) -> tuple[int, int]:
    """``"i/N"`` -> ``(i, N)``, checked."""
    index_text, slash, count_text = text.partition("/")
    try:
        index, count = int(index_text), int(count_text)
    except ValueError:
        index, count = -1, 0
    if not slash or count < 1 or not 0 <= index < count:
        raise UserError(f"shard must be i/N with 0 <= i < N (e.g. 0/4), got {text!r}")
    return index, count


class _Writer:
    """Writes shards on a thread and records each in the manifest once it is on disk."""

    def __init__(self, folder: Path, manifest: Manifest, progress: Progress) -> None:
        self.folder, self.manifest, self.progress = folder, manifest, progress
        self.metadata = {"format": FORMAT, "fingerprint": manifest.fingerprint}
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tl-capture-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # drain: the run is failing
            index, tensors, summary = item
            try:
                record = write_shard(
                    self.folder, index, tensors, {**self.metadata, "shard": str(index)}, summary
                )
                self.manifest.shards[index] = record
                self.manifest.save(self.folder)
                self.progress.update(shards=1)
            except BaseException as error:  # re-raised in the run's thread
                self._error = error

    def put(self, index: int, tensors: dict[str, torch.Tensor], summary: dict[str, int]) -> None:
        self._raise()
        self._queue.put((index, tensors, summary))

    def close(self, total_shards: int | None) -> None:
        """Wait for queued shards; record the job's shard count when the input was read."""
        self._queue.put(None)
        self._thread.join()
        self._raise()
        if total_shards is not None:
            self.manifest.total_shards = total_shards
            self.manifest.save(self.folder)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


def _shard_tensors(shard: Sequence[Context], plan: HookPlan) -> dict[str, torch.Tensor]:
    """The shard's tensors: row fields filled from its contexts, hooks allocated to fill."""
    stored = [torch.tensor(c.stored) for c in shard]
    rows = int(sum(int(m.sum()) for m in stored))
    tensors = {
        "tokens": torch.cat([torch.tensor(c.tokens, dtype=torch.int32)[m] for c, m in zip(shard, stored, strict=True)]),
        "documents": torch.cat([torch.tensor(c.documents, dtype=torch.int64)[m] for c, m in zip(shard, stored, strict=True)]),
        "contexts": torch.cat([torch.full((int(m.sum()),), c.index, dtype=torch.int64) for c, m in zip(shard, stored, strict=True)]),
        "positions": torch.cat([torch.arange(len(m), dtype=torch.int32)[m] for m in stored]),
    }
    for name, record in plan.hooks.items():
        tensors[name] = torch.empty((rows, *record.shape), dtype=getattr(torch, record.dtype))
    return tensors


def _fill_batch(
    bridge: Any,
    batch: Sequence[Context],
    plan: HookPlan,
    config: CaptureConfig,
    stop: int | None,
    tensors: dict[str, torch.Tensor],
    first_row: int,
) -> int:
    """Run one batch and copy its stored positions' rows into the shard's tensors from
    ``first_row``; returns the rows written."""
    _, cache = bridge.run_with_cache(
        [c.tokens for c in batch],
        names_filter=plan.names,
        return_type=None,
        prepend_bos=False,
        device="cpu",
        intervene=config.intervene,
        stop_at_layer=stop,
    )
    width = max(len(c.tokens) for c in batch)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for b, context in enumerate(batch):
        mask[b, : len(context.tokens)] = torch.tensor(context.stored)
    where = mask.flatten().nonzero().flatten()
    end = first_row + where.numel()
    for name in plan.hooks:
        value = cache[name][:, :width]
        flat = value.reshape(-1, *value.shape[2:])
        target = tensors[name][first_row:end]
        if flat.dtype == target.dtype:
            torch.index_select(flat, 0, where, out=target)  # one copy, straight into the shard
        else:
            target.copy_(flat[where])
    return end - first_row


def _summary(shard: Sequence[Context]) -> dict[str, int]:
    documents = [d for c in shard for d in c.documents if d >= 0]
    return {
        "first_context": shard[0].index,
        "contexts": len(shard),
        "first_document": min(documents, default=-1),
        "last_document": max(documents, default=-1),
        "tokens": sum(len(c.tokens) for c in shard),
    }


def _check_output(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise UserError(f"output {folder} is a file; a capture store is a folder")
    if folder.is_dir() and not (folder / MANIFEST).exists() and any(p.name != ".lock" for p in folder.iterdir()):
        raise UserError(f"{folder} is not empty and holds no capture store; choose a new or empty folder")
    if (folder / MANIFEST).exists():
        Manifest.load(folder)  # a damaged manifest is reported before the model boots


def capture(
    config: CaptureConfig,
    output: str | Path,
    *,
    part: tuple[int, int] | str = (0, 1),
    repair: bool = False,
    progress: bool = True,
    bridge: Any = None,
) -> CaptureSummary:
    """Capture ``config.hooks`` over ``config.input`` into the store at ``output``.

    Rerunning the same call continues an interrupted store: recorded shards are checked
    and kept, the rest computed. Every check that needs no model runs before the driver
    boots.

    Args:
        config: The job.
        output: The store folder (created; or an existing store of the same job).
        part: ``(i, N)`` or ``"i/N"``: compute only this part's shards (every N-th shard,
            from shard i); each part needs its own folder, and ``merge_stores`` joins them.
        repair: Redo recorded shards that are missing or damaged instead of refusing.
        progress: Show the progress line on stderr.
        bridge: A booted bridge to use instead of booting ``config.model`` (its driver must
            be ``config.driver``; it is not closed).

    Returns:
        What the run did.

    Raises:
        UserError: Bad options, a mismatched or damaged store, another writer, an input
            without tokens; each message says what to change.
    """
    started = time.perf_counter()
    part = parse_part(part) if isinstance(part, str) else parse_part(f"{part[0]}/{part[1]}")
    folder = Path(output)
    _check_output(folder)
    source = open_source(config.input, config.input_format, config.text_field)
    owned = bridge is None
    if bridge is None:
        from tl_core.bridges._boot import boot

        bridge = boot(config.model, driver=config.driver, **config.boot_options)
    elif getattr(bridge.driver, "name", config.driver) != config.driver:
        raise UserError(f"the bridge runs driver {bridge.driver.name!r}, the config names {config.driver!r}")
    try:
        Tokens.of(bridge.tokenizer, config)
        probe = bridge.tokenizer.bos_token_id
        plan = plan_hooks(bridge, config, probe if probe is not None else 0)
        wanted = identity(config, plan, bridge, source.digest(), shard_contexts(config, plan))
        folder.mkdir(parents=True, exist_ok=True)
        with StoreLock(folder):
            manifest, notes = open_store(folder, wanted, plan, part, repair=repair)
            before = len(manifest.shards)
            display = Progress(enabled=progress)
            if manifest.complete:
                written = (0, 0, 0)
            else:
                written = _run(bridge, config, plan, manifest, folder, source, display)
            display.close()
        return CaptureSummary(
            store=folder,
            shards_written=written[0],
            shards_before=before,
            rows_written=written[1],
            tokens_written=written[2],
            seconds=time.perf_counter() - started,
            complete=manifest.complete,
            notes=tuple(notes),
        )
    finally:
        if owned:
            bridge.close()


def _run(
    bridge: Any,
    config: CaptureConfig,
    plan: HookPlan,
    manifest: Manifest,
    folder: Path,
    source: DocumentSource,
    display: Progress,
) -> tuple[int, int, int]:
    """Compute this part's missing shards; returns (shards, rows, tokens) written."""
    per_shard = int(manifest.identity["config"]["shard_contexts"])
    stop = stop_layer(plan.names, bridge.cfg.n_layers)
    done = set(manifest.shards)
    writer = _Writer(folder, manifest, display)
    counts = [0, 0, 0]
    total: int | None = None

    def flush(index: int, shard: list[Context]) -> None:
        if not manifest.owns(index) or index in done:
            display.update(fraction=shard[-1].progress)
            return
        tensors = _shard_tensors(shard, plan)
        row = 0
        for start in range(0, len(shard), config.batch_size):
            batch = shard[start : start + config.batch_size]
            row += _fill_batch(bridge, batch, plan, config, stop, tensors, row)
            ran = sum(len(c.tokens) for c in batch)
            counts[2] += ran
            display.update(tokens=ran, fraction=batch[-1].progress)
        assert row == tensors["tokens"].shape[0], "every stored position got its row"
        counts[0] += 1
        counts[1] += row
        writer.put(index, tensors, _summary(shard))

    try:
        index, shard = 0, []
        with torch.no_grad():
            for context in contexts(source, bridge.tokenizer, config):
                shard.append(context)
                if len(shard) == per_shard:
                    flush(index, shard)
                    index, shard = index + 1, []
            if shard:
                flush(index, shard)
                index += 1
        if index == 0:
            raise UserError(f"input {config.input} holds no tokens to capture")
        total = index
    finally:
        writer.close(total)
    return counts[0], counts[1], counts[2]

