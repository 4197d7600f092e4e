"""``CaptureStore``: read a capture store as torch tensors, for SAE and probe training loops.

Opening a store checks it whole (manifest, every shard's entry against the shard's size and
header, and its checksum), so a training run never starts on a damaged, edited or mixed
store. Rows are read from memory-mapped shard files: in order, through a shuffle buffer, or
at random through a ``torch.utils.data.Dataset``.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tl_core._errors import TLError, UserError
from tl_core.capture._manifest import Manifest
from tl_core.capture._shards import ROW_FIELDS
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._resolution import canonical_name

__all__ = ["CaptureStore", "RowDataset", "checked_device"]

#: Rows read from a shard file at once when streaming (then cut into batches).
_CHUNK_BYTES = 64 * 2**20
_BUFFER_BYTES = 512 * 2**20


def _devices() -> list[str]:
    """The devices this machine has, as names."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def checked_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a ``torch.device`` this machine has, checked before any row is read.

    Raises:
        UserError: Not a device name, the meta device (which holds no data), or a device
            this machine does not have (listing those it has).
    """
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise UserError(
            f"device={device!r} is not a torch device ({error}); this machine has "
            f"{', '.join(_devices())}"
        ) from None
    if target.type == "meta":
        raise UserError(
            f"device={device!r} holds no data, so every batch would be empty of values; this "
            f"machine has {', '.join(_devices())}"
        )
    try:
        torch.empty(0, device=target)
    except (RuntimeError, AssertionError, ValueError) as error:
        raise UserError(
            f"device={device!r} is not available here ({str(error).strip() or type(error).__name__}); "
            f"this machine has {', '.join(_devices())}: pass one of them, or None to keep "
            f"batches where they are read (the CPU)"
        ) from None
    return target


class CaptureStore:
    """A complete capture store, opened for reading.

    Args:
        path: The store folder.
        verify: Check every shard's checksum on open (reads the store once; size, header,
            fingerprint and every field of each shard's manifest entry are always checked).
        allow_incomplete: Open a store whose capture has not finished (or one part of a
            sharded job) and read its complete shards.

    Raises:
        UserError: Not a store, an edited manifest, a missing, truncated, altered or
            foreign shard, or an incomplete store (unless allowed); each message says how
            to recover.
    """

    def __init__(
        self, path: str | Path, *, verify: bool = True, allow_incomplete: bool = False
    ) -> None:
        #: The store's folder.
        self.folder = Path(path)
        #: The store's manifest: hooks, dtypes, shards, progress and the run's settings.
        self.manifest = Manifest.load(self.folder)
        manifest = self.manifest
        if not allow_incomplete:
            if manifest.part[1] != 1:
                raise UserError(
                    f"{self.folder} is part {manifest.part[0]}/{manifest.part[1]} of a sharded job; "
                    f"join the parts with `tl capture merge` (or pass allow_incomplete=True to read this part)"
                )
            if not manifest.complete:
                total = manifest.total_shards if manifest.total_shards is not None else "?"
                raise UserError(
                    f"{self.folder} is incomplete ({len(manifest.shards)} of {total} shards): rerun "
                    f"the capture to finish it, or pass allow_incomplete=True to read what is there"
                )
        manifest.check_shards(self.folder, checksum=verify)
        self._order = sorted(manifest.shards)
        self._starts = [0]
        for index in self._order:
            self._starts.append(self._starts[-1] + manifest.shards[index].rows)

    # -- facts ------------------------------------------------------------------------

    @property
    def hooks(self) -> list[str]:
        """The canonical names of the captured hooks."""
        return list(self.manifest.hooks)

    @property
    def config(self) -> dict[str, Any]:
        """The capture's configuration, as recorded."""
        return dict(self.manifest.identity["config"])

    def __len__(self) -> int:
        return self._starts[-1]

    def field(self, name: str) -> str:
        """The stored name of a hook (any of its names) or a row field.

        Raises:
            UserError: Not in this store (lists what is).
        """
        if name in self.manifest.hooks or name in ROW_FIELDS:
            return name
        for stored, record in self.manifest.hooks.items():
            if record.requested == name:
                return stored
        alias: str | None
        try:  # any other alias of a captured hook, resolved for the captured model
            alias = canonical_name(name, info=ModelInfo(**self.manifest.identity["model"]))
        except TLError:
            alias = None
        if alias in self.manifest.hooks:
            return alias
        raise UserError(
            f"{name!r} is not in the store {self.folder}; it holds {self.hooks} and the row "
            f"fields {list(ROW_FIELDS)}"
        )

    def row_shape(self, name: str) -> tuple[int, ...]:
        """The shape of one row of a hook (``()`` for a row field)."""
        name = self.field(name)
        return self.manifest.hooks[name].shape if name in self.manifest.hooks else ()

    def __repr__(self) -> str:
        return f"CaptureStore({str(self.folder)!r}, rows={len(self)}, hooks={self.hooks})"

    # -- reading ----------------------------------------------------------------------

    def _path(self, position: int) -> str:
        return str(self.folder / self.manifest.shards[self._order[position]].file)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of a hook or row field, across shards (a copy)."""
        from safetensors import safe_open

        for bound, value in (("start", start), ("stop", stop)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise UserError(f"read: {bound} must be a row number (int), got {value!r}")
        name = self.field(name)
        stop = len(self) if stop is None else min(stop, len(self))
        if not 0 <= start <= stop:
            raise UserError(f"rows {start}:{stop} are out of range for a store of {len(self)} rows")
        pieces = []
        shard = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while start < stop and shard < len(self._order):
            begin, end = self._starts[shard], self._starts[shard + 1]
            if end > start:
                with safe_open(self._path(shard), framework="pt") as handle:
                    pieces.append(handle.get_slice(name)[start - begin : min(stop, end) - begin])
                start = min(stop, end)
            shard += 1
        if not pieces:
            return torch.empty((0, *self.row_shape(name)), dtype=self._dtype(name))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def _dtype(self, name: str) -> torch.dtype:
        if name in self.manifest.hooks:
            return getattr(torch, self.manifest.hooks[name].dtype)  # type: ignore[no-any-return]
        return torch.int32 if name in ("tokens", "positions") else torch.int64

    def _chunks(
        self, names: Sequence[str], order: Sequence[int]
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Consecutive row chunks of the given shard positions."""
        from safetensors import safe_open

        row_bytes = sum(
            max(1, int(torch.tensor(self.row_shape(n)).prod()))
            * torch.empty((), dtype=self._dtype(n)).element_size()
            for n in names
        )
        step = max(1, _CHUNK_BYTES // row_bytes)
        for position in order:
            rows = self._starts[position + 1] - self._starts[position]
            with safe_open(self._path(position), framework="pt") as handle:
                for start in range(0, rows, step):
                    yield {n: handle.get_slice(n)[start : start + step] for n in names}

    def iter_batches(
        self,
        name: str,
        batch_size: int = 4096,
        *,
        fields: Sequence[str] = (),
        shuffle: bool = False,
        seed: int | None = None,
        buffer_rows: int | None = None,
        drop_last: bool = False,
        device: torch.device | str | None = None,
    ) -> Iterator[Any]:
        """Stream the store in batches of rows.

        Every argument is checked when this is called, before a row is read.

        Args:
            name: A hook (canonical or as requested) or row field.
            batch_size: Rows per batch.
            fields: Other hooks or row fields to return alongside (then each batch is a
                dict by name), e.g. ``("tokens",)``.
            shuffle: Visit shards in a random order and mix rows through a buffer.
            seed: The shuffle's seed (default 0; same seed, same order); only with
                ``shuffle``.
            buffer_rows: Rows mixed together when shuffling (default: about 512 MiB); only
                with ``shuffle``.
            drop_last: Drop a final batch shorter than ``batch_size``.
            device: Where batches go (a device this machine has).

        Returns:
            An iterator of ``[batch, *row_shape]`` tensors, or dicts of them when
            ``fields`` are given.

        Raises:
            UserError: A bad value (naming the argument), ``seed`` or ``buffer_rows``
                without ``shuffle``, a name the store does not hold, or a device this
                machine does not have (listing those it has).
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"batch_size must be an int >= 1, got {batch_size!r}")
        for flag, value in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(value, bool):
                raise UserError(f"{flag} must be True or False, got {value!r}")
        if not shuffle and (seed is not None or buffer_rows is not None):
            given = "seed" if seed is not None else "buffer_rows"
            raise UserError(
                f"{given}={seed if seed is not None else buffer_rows!r} only affects a "
                f"shuffled read, but shuffle=False reads rows in order, so it would be "
                f"ignored; pass shuffle=True, or drop {given}"
            )
        seed = 0 if seed is None else seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
            raise UserError(
                f"seed must be an int (torch's generator takes -2**63 to 2**64 - 1), got {seed!r}"
            )
        if buffer_rows is not None and (
            isinstance(buffer_rows, bool) or not isinstance(buffer_rows, int) or buffer_rows < 1
        ):
            raise UserError(
                f"buffer_rows must be an int >= 1 (rows mixed together when shuffling), or None "
                f"for about 512 MiB, got {buffer_rows!r}"
            )
        target = checked_device(device)
        labels = self._labels(name, fields)
        return self._batches(labels, batch_size, shuffle, seed, buffer_rows, drop_last, target)

    def _batches(
        self,
        labels: dict[str, str],
        batch_size: int,
        shuffle: bool,
        seed: int,
        buffer_rows: int | None,
        drop_last: bool,
        device: torch.device | None,
    ) -> Iterator[Any]:
        """``iter_batches``' rows, its arguments checked."""
        names = list(labels)
        generator = torch.Generator().manual_seed(seed)
        order = list(range(len(self._order)))
        if shuffle:
            order = [order[i] for i in torch.randperm(len(order), generator=generator).tolist()]
            if buffer_rows is None:
                row_bytes = max(1, int(torch.tensor(self.row_shape(names[0])).prod())) * 4
                buffer_rows = max(batch_size, _BUFFER_BYTES // row_bytes)
        pending: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        held = 0
        limit = buffer_rows if shuffle and buffer_rows else batch_size
        for chunk in self._chunks(names, order):
            for n in names:
                pending[n].append(chunk[n])
            held += int(chunk[names[0]].shape[0])
            if held >= limit:
                yield from self._emit(
                    pending, labels, batch_size, shuffle, generator, device, final=False
                )
                held = sum(int(t.shape[0]) for t in pending[names[0]])
        yield from self._emit(
            pending, labels, batch_size, shuffle, generator, device, final=True, drop_last=drop_last
        )

    def _labels(self, name: str, fields: Sequence[str]) -> dict[str, str]:
        """Stored name -> the name the caller used, for the hook and its fields."""
        if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
            shown = [fields] if isinstance(fields, str) else "a list of names"
            raise UserError(
                f"fields must be a list of hook or row field names, got {fields!r}; e.g. "
                f"fields={shown!r}"
            )
        labels: dict[str, str] = {}
        for given in (name, *fields):
            labels.setdefault(self.field(given), given)
        return labels

    def _emit(
        self,
        pending: dict[str, list[torch.Tensor]],
        labels: dict[str, str],
        batch_size: int,
        shuffle: bool,
        generator: torch.Generator,
        device: torch.device | str | None,
        *,
        final: bool,
        drop_last: bool = False,
    ) -> Iterator[Any]:
        names = list(labels)
        if not pending[names[0]]:
            return
        joined = {n: torch.cat(pending[n]) for n in names}
        rows = int(joined[names[0]].shape[0])
        if shuffle:
            permutation = torch.randperm(rows, generator=generator)
            joined = {n: t[permutation] for n, t in joined.items()}
        usable = rows if final else rows - rows % batch_size
        for start in range(0, usable, batch_size):
            if final and drop_last and start + batch_size > rows:
                break
            batch = {labels[n]: t[start : start + batch_size] for n, t in joined.items()}
            if device is not None:
                batch = {n: t.to(device) for n, t in batch.items()}
            yield batch if len(names) > 1 else next(iter(batch.values()))
        for n in names:
            pending[n] = [] if final else [joined[n][usable:]]

    def dataset(self, name: str, fields: Sequence[str] = ()) -> RowDataset:
        """A map-style ``torch.utils.data.Dataset`` over the rows of a hook (and ``fields``);
        items are tensors, or dicts keyed by the names given when ``fields`` are."""
        return RowDataset(self, self._labels(name, fields))

    def info(self) -> str:
        """A short human-readable summary of the store."""
        manifest = self.manifest
        config = manifest.identity["config"]
        hooks = "\n".join(
            f"  {n} (asked as {h.requested}): rows of {list(h.shape)} {h.dtype}"
            for n, h in manifest.hooks.items()
        )
        return (
            f"{self.folder}: {len(self):,} rows from {manifest.tokens:,} tokens in "
            f"{len(manifest.shards)} shards\nmodel {config['model']!r} on driver "
            f"{config['driver']!r}; {json.dumps(manifest.identity['versions'])}\nhooks:\n{hooks}"
        )


class RowDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Rows of a store by global index; shard files open lazily, once per process."""

    def __init__(self, store: CaptureStore, labels: dict[str, str]) -> None:
        self._paths = [store._path(i) for i in range(len(store._order))]
        self._starts = list(store._starts)
        self._labels = labels
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self._starts[-1]

    def _handle(self, shard: int) -> Any:
        from safetensors import safe_open

        if os.getpid() != self._pid:  # a DataLoader worker: open its own files
            self._handles, self._pid = {}, os.getpid()
        if shard not in self._handles:
            self._handles[shard] = safe_open(self._paths[shard], framework="pt")
        return self._handles[shard]

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} is out of range for {len(self)} rows")
        shard = bisect.bisect_right(self._starts, index) - 1
        offset = index - self._starts[shard]
        handle = self._handle(shard)
        rows = {
            label: handle.get_slice(n)[offset : offset + 1][0] for n, label in self._labels.items()
        }
        return rows if len(rows) > 1 else next(iter(rows.values()))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}
