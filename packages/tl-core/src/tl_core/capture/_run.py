"""``capture``: run a job's contexts through a bridge and write the store, resumably.

The contexts are cut into shards of ``shard_contexts``; each shard is computed in whole
batches and handed to a writer thread, which writes it atomically and then records it in
the manifest. The model computes the next shard meanwhile. A rerun skips recorded shards,
and a part of a sharded job (``part=(i, N)``) computes only shards ``i, i + N, ...``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tl_core._errors import UserError
from tl_core.capture._checks import (
    booted_limit,
    check_context_size,
    check_intervene_on,
)
from tl_core.capture._config import CaptureConfig
from tl_core.capture._contexts import Context, Tokens, contexts
from tl_core.capture._job import (
    HookPlan,
    attach_dictionaries,
    identity,
    open_store,
    plan_hooks,
    shard_contexts,
    stop_layer,
)
from tl_core.capture._lock import StoreLock
from tl_core.capture._manifest import FORMAT, MANIFEST, Manifest
from tl_core.capture._model_files import (
    comparable,
    describe_model,
    model_mismatch,
    refreshed,
)
from tl_core.capture._preflight import SPECS, Preflight, preflight
from tl_core.capture._progress import Progress
from tl_core.capture._shards import shard_name, write_shard
from tl_core.capture._source import DocumentSource
from tl_core.hooks._vocabulary import on_decoder_positions

__all__ = [
    "CaptureSummary",
    "capture",
    "capture_attempt",
    "disk_full",
    "parse_part",
]

_LOG = logging.getLogger("tl_core.capture")

#: Errors of a write that found no space left (on the disk, or in the user's quota).
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


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
            doing = f"writing shard {index} ({shard_name(index)})"
            try:
                record = write_shard(
                    self.folder, index, tensors, {**self.metadata, "shard": str(index)}, summary
                )
                doing = (
                    f"recording shard {index} in the manifest (the shard is redone on the rerun)"
                )
                self.manifest.shards[index] = record
                self.manifest.save(self.folder)
                self.progress.update(shards=1)
            except OSError as error:
                self._error = error
                if error.errno in _NO_SPACE:
                    self.manifest.shards.pop(index, None)
                    size = sum(t.numel() * t.element_size() for t in tensors.values())
                    self._error = disk_full(
                        error, self.folder, doing, len(self.manifest.shards), size
                    )
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
            try:
                self.manifest.save(self.folder)
            except OSError as error:
                if error.errno not in _NO_SPACE:
                    raise
                doing = "recording that every shard is written"
                raise disk_full(error, self.folder, doing, len(self.manifest.shards)) from error

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


def _shard_tensors(shard: Sequence[Context], plan: HookPlan) -> dict[str, torch.Tensor]:
    """The shard's tensors: row fields filled from its contexts, hooks allocated to fill."""
    stored = [torch.tensor(c.stored) for c in shard]
    rows = int(sum(int(m.sum()) for m in stored))
    tensors = {
        "tokens": torch.cat(
            [
                torch.tensor(c.tokens, dtype=torch.int32)[m]
                for c, m in zip(shard, stored, strict=True)
            ]
        ),
        "documents": torch.cat(
            [
                torch.tensor(c.documents, dtype=torch.int64)[m]
                for c, m in zip(shard, stored, strict=True)
            ]
        ),
        "contexts": torch.cat(
            [
                torch.full((int(m.sum()),), c.index, dtype=torch.int64)
                for c, m in zip(shard, stored, strict=True)
            ]
        ),
        "positions": torch.cat([torch.arange(len(m), dtype=torch.int32)[m] for m in stored]),
    }
    for name, record in plan.hooks.items():
        tensors[name] = torch.empty((rows, *record.shape), dtype=getattr(torch, record.dtype))
    return tensors


def _check_padding(bridge: Any, config: CaptureConfig) -> None:
    """Refuse stored padding on a model that attends both ways.

    Raises:
        UserError: ``drop_padding=False`` on an encoder, whose real positions would read the
            padding tokens (a causal model's never do).
    """
    if not config.drop_padding and getattr(bridge.driver, "masks_padding", False):
        raise UserError(
            "drop_padding=False pads short contexts with real padding tokens, and this model "
            "attends both ways (an encoder): every position of the context would read them, "
            "so its activations would depend on the padding. Keep drop_padding=True (the "
            "default; drop --keep-padding), which runs short contexts with the padding masked"
        )


def _refuse_decoder_sites(bridge: Any, names: Sequence[str]) -> None:
    """Refuse, on an encoder-decoder, sites over the decoder's positions: a store holds one
    row per corpus token, and the corpus is what the encoder reads.

    Raises:
        UserError: Naming the sites, and what to capture instead.
    """
    if not getattr(bridge.driver, "encoder_decoder", False):
        return
    decoder = [n for n in names if on_decoder_positions(n)]
    if decoder:
        raise UserError(
            f"tl capture stores one row per corpus token, which an encoder-decoder's encoder "
            f"reads; {decoder[:3]} lie over the decoder's positions (its start token alone "
            "here): capture encoder_blocks.* sites (or cross-attention's hook_k/hook_v, which "
            "lie over the encoder's), or run decoder inputs from Python with run_with_cache("
            "..., decoder_input=...); nothing was written"
        )


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


def disk_full(
    error: OSError, folder: Path, doing: str, recorded: int, shard_bytes: int = 0
) -> UserError:
    """The error of a write that found the disk (or the user's quota) full."""
    kept = (
        f"{recorded} shard(s) are complete and recorded in {folder / MANIFEST}"
        if recorded
        else "no shard is recorded yet"
    )
    size = (
        f" (a shard of this job takes about {shard_bytes / 2**20:,.0f} MiB)" if shard_bytes else ""
    )
    return UserError(
        f"the disk holding {folder} is full ({error.strerror or error}) while {doing}; {kept}. "
        f"Free space on that disk{size}, or move the store to a larger one, and rerun the "
        f"same command: it keeps every recorded shard, removes what this run left half "
        f"written, and continues after the last complete shard"
    )


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
    boots (the input is read once in full, the specs' structure, the context size where the
    model's config is readable, the store's configuration, the lock); the rest runs right
    after the boot. Nothing is written before the first shard is ready.

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
        UserError: Bad options; an empty, binary or non-UTF-8 input, or records without
            the text field; a context longer than the model takes; a mismatched or damaged
            store; another writer; a full disk. Each message says what to change.
        SpecError: Malformed specs in ``intervene``, or specs the model cannot apply.
    """
    return capture_attempt(
        config, output, part=part, repair=repair, progress=progress, bridge=bridge, job=None
    )


def capture_attempt(
    config: CaptureConfig,
    output: str | Path,
    *,
    part: tuple[int, int] | str,
    repair: bool,
    progress: bool,
    bridge: Any,
    job: str | None,
    expected_model: dict[str, Any] | None = None,
) -> CaptureSummary:
    """``capture``, as one attempt of ``job`` when it is given: the store's lock left by an
    earlier attempt of the same job is taken over from any host (see ``StoreLock``).

    ``expected_model`` is the record of the model's files where the job was submitted
    (``capture_on_ray``): a machine that reads other files at the model's path is refused
    before it boots."""
    started = time.perf_counter()
    part = parse_part(part) if isinstance(part, str) else parse_part(f"{part[0]}/{part[1]}")
    folder = Path(output)
    # Everything that needs no model is checked before it boots, and nothing is written
    # before the first shard: a failed run leaves no store to refuse the corrected rerun.
    checked = preflight(config, [(folder, part)])
    if expected_model is not None and comparable(checked.model):
        what = model_mismatch(expected_model, checked.model)
        if what is not None:
            raise UserError(
                f"{socket.gethostname()} reads {describe_model(checked.model)}, but the job was "
                f"submitted with {describe_model(expected_model)}; {what}. Every node that runs "
                f"a part must see the same checkpoint at the same path (a shared file system, "
                f"or identical copies); nothing was written"
            )
    if bridge is not None and getattr(bridge.driver, "name", config.driver) != config.driver:
        raise UserError(
            f"the bridge runs driver {bridge.driver.name!r}, the config names {config.driver!r}"
        )
    created = not folder.exists()
    try:
        with _no_space(folder, "taking the store's lock"):
            folder.mkdir(parents=True, exist_ok=True)
            lock = StoreLock(folder, job=job).acquire()  # a live writer is refused before the boot
        try:
            for note in lock.notes:
                _LOG.warning("tl capture: %s", note)
            counts, manifest, notes = _boot_and_run(
                config, folder, checked, part, repair, progress, bridge
            )
        finally:
            lock.release()
    finally:
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # a run that failed before its first shard leaves no folder behind
    return CaptureSummary(
        store=folder,
        shards_written=counts[0],
        shards_before=counts[3],
        rows_written=counts[1],
        tokens_written=counts[2],
        seconds=time.perf_counter() - started,
        complete=manifest.complete,
        notes=tuple(lock.notes + notes),
    )


def _boot_and_run(
    config: CaptureConfig,
    folder: Path,
    checked: Preflight,
    part: tuple[int, int],
    repair: bool,
    progress: bool,
    bridge: Any,
) -> tuple[tuple[int, int, int, int], Manifest, list[str]]:
    """Boot (unless given a bridge), check what the model decides, then write the store.

    Returns:
        (shards, rows, tokens written, shards there before), the manifest, and the notes.
    """
    owned = bridge is None
    if bridge is None:
        from tl_core.bridges._boot import boot

        bridge = boot(config.model, driver=config.driver, **config.boot_options)
    spliced: list[Any] = []
    try:
        reads = getattr(bridge.driver, "signal_input", None)
        if reads is not None:
            raise UserError(
                f"tl capture runs a text corpus through the model, and {config.model!r} reads "
                f"{reads}, not text: capture its activations from Python "
                "(bridge.run_with_cache(pixels_or_audio, names_filter=...)); nothing was written"
            )
        spliced.extend(attach_dictionaries(bridge, config, checked.dictionaries))
        limit = booted_limit(bridge, config)
        if limit is not None:
            check_context_size(config, limit, booted=True)
        Tokens.of(bridge.tokenizer, config)
        _check_padding(bridge, config)
        check_intervene_on(bridge, config, SPECS)
        probe = bridge.tokenizer.bos_token_id
        plan = plan_hooks(bridge, config, probe if probe is not None else 0)
        _refuse_decoder_sites(bridge, plan.names)
        model = refreshed(config, checked.model)  # a hub id is what the boot resolved
        wanted = identity(config, plan, bridge, checked.digest, shard_contexts(config, plan), model)
        with _no_space(folder, "writing the store"):
            manifest, notes = open_store(folder, wanted, plan, part, repair=repair)
            before = len(manifest.shards)
            display = Progress(enabled=progress)
            written = (
                (0, 0, 0)
                if manifest.complete
                else _run(bridge, config, plan, manifest, folder, checked.source, display)
            )
            display.close()
        return (*written, before), manifest, notes
    finally:
        # A given bridge goes back as it came.
        for splice in spliced:
            splice.remove()
        if owned:
            bridge.close()


@contextlib.contextmanager
def _no_space(folder: Path, doing: str) -> Iterator[None]:
    """Report a full disk (``OSError`` ENOSPC or EDQUOT) as a ``UserError`` saying what to do."""
    try:
        yield
    except OSError as error:
        if error.errno not in _NO_SPACE:
            raise
        try:
            recorded = len(Manifest.load(folder).shards)
        except UserError:
            recorded = 0  # no manifest yet
        raise disk_full(error, folder, doing, recorded) from error


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

    def written() -> int:
        return len(done) + counts[0]

    try:
        index, shard = 0, []
        with torch.no_grad():
            for context in _guarded(contexts(source, bridge.tokenizer, config), folder, written):
                shard.append(context)
                if len(shard) == per_shard:
                    flush(index, shard)
                    index, shard = index + 1, []
            if shard:
                flush(index, shard)
                index += 1
        if index == 0:
            raise UserError(
                f"input {config.input} holds no tokens to capture: every document is empty; "
                f"nothing was written to {folder}. Point input (--input) at a corpus with text"
            )
        total = index
    finally:
        writer.close(total)
    return counts[0], counts[1], counts[2]


def _guarded(
    items: Iterator[Context], folder: Path, written: Callable[[], int]
) -> Iterator[Context]:
    """``items``, with what becomes of the store added to an input error found mid-run
    (records past the ones checked before the boot are read only now)."""
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except UserError as error:
            shards = written()
            if shards == 0:
                after = (
                    f"Nothing was written to {folder}; fix the input and rerun the same command."
                )
            else:
                after = (
                    f"{folder} keeps the {shards} shard(s) cut before that line, but a corrected "
                    f"input is another input (its digest changes), which that store cannot "
                    f"continue: rerun with a new output folder, or delete {folder} first."
                )
            raise UserError(f"{error}. {after}") from None
        yield item
