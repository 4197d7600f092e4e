"""The manifest of a capture store: what the job is, and which shards are complete.

``manifest.json`` is rewritten atomically (temporary file, flush, rename) after each shard,
so after any interruption it lists exactly the shards that were completely written.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tl_core._errors import UserError
from tl_core.capture._config import fingerprint
from tl_core.capture._shards import ShardRecord, check_shard, fsync_folder

__all__ = ["FORMAT", "MANIFEST", "HookRecord", "Manifest", "identity_differences"]

FORMAT = "tl-capture"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

#: Totals the manifest records for readers of the JSON; tl derives them from the entries.
_TOTALS = ("rows", "tokens", "complete")


@dataclass(frozen=True)
class HookRecord:
    """One captured hook: the name asked for, and each row's shape and dtype."""

    requested: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Manifest:
    """A store's manifest.

    Attributes:
        identity: What decides the store's content: the config, the input's digest, the
            model's sizes and the software versions. Resuming requires the same identity.
        hooks: Canonical hook name -> its record, in capture order.
        part: ``(index, count)`` of this part of a sharded job (``(0, 1)``: the whole job).
        shards: Complete shards by number.
        total_shards: How many shards the whole job has, once a run reached the input's end.
        recorded_totals: The totals a loaded manifest recorded, to check against the entries.
    """

    identity: dict[str, Any]
    hooks: dict[str, HookRecord]
    part: tuple[int, int] = (0, 1)
    shards: dict[int, ShardRecord] = field(default_factory=dict)
    total_shards: int | None = None
    #: ``rows``, ``tokens`` and ``complete`` as the file recorded them (see ``check_totals``).
    recorded_totals: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def fingerprint(self) -> str:
        """The hash of ``identity``; every shard's header carries it."""
        return fingerprint(self.identity)

    def owns(self, shard: int) -> bool:
        """Whether shard ``shard`` belongs to this part."""
        return shard % self.part[1] == self.part[0]

    @property
    def complete(self) -> bool:
        """Whether every shard of this part is written."""
        if self.total_shards is None:
            return False
        return all(i in self.shards for i in range(self.total_shards) if self.owns(i))

    @property
    def rows(self) -> int:
        """Stored positions in the complete shards."""
        return sum(s.rows for s in self.shards.values())

    @property
    def tokens(self) -> int:
        """Model input tokens of the complete shards."""
        return sum(s.tokens for s in self.shards.values())

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON values."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "identity": self.identity,
            "hooks": {
                name: {"requested": h.requested, "shape": list(h.shape), "dtype": h.dtype}
                for name, h in self.hooks.items()
            },
            "part": {"index": self.part[0], "count": self.part[1]},
            "total_shards": self.total_shards,
            "complete": self.complete,
            "rows": self.rows,
            "tokens": self.tokens,
            "shards": [self.shards[i].to_json() for i in sorted(self.shards)],
        }

    def save(self, folder: Path) -> None:
        """Write ``manifest.json`` atomically."""
        data = self.to_json()
        temporary = folder / f".{MANIFEST}.partial"
        try:
            with temporary.open("w") as handle:
                json.dump(data, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        os.replace(temporary, folder / MANIFEST)
        fsync_folder(folder)
        self.recorded_totals = {name: data[name] for name in _TOTALS}

    @classmethod
    def load(cls, folder: Path) -> Manifest:
        """Read and check a store's manifest.

        Checks what needs no shard file: the identity against its fingerprint, the hooks
        against the identity, the shard entries (once each, in index order, each one of this
        part's). ``check_shard`` checks each entry against its file, then ``check_totals``
        the recorded totals against the entries.

        Raises:
            UserError: No manifest, not a tl capture manifest, or one edited by hand (its
                fields do not fit together).
        """
        path = folder / MANIFEST
        if not path.is_file():
            raise UserError(f"{folder} is not a capture store: it has no {MANIFEST}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise UserError(
                f"{path} is not valid JSON ({error.msg} at line {error.lineno}): the manifest is damaged"
            ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UserError(
                f"{path} is not a tl capture manifest (format {data.get('format') if isinstance(data, dict) else None!r})"
            )
        if data.get("format_version") != FORMAT_VERSION:
            raise UserError(
                f"{path} has format version {data.get('format_version')!r}; this tl-core reads "
                f"version {FORMAT_VERSION}"
            )
        try:
            listed = [int(s["index"]) for s in data["shards"]]
            manifest = cls(
                identity=dict(data["identity"]),
                hooks={
                    name: HookRecord(
                        h["requested"], tuple(int(n) for n in h["shape"]), str(h["dtype"])
                    )
                    for name, h in data["hooks"].items()
                },
                part=(int(data["part"]["index"]), int(data["part"]["count"])),
                shards={int(s["index"]): ShardRecord(**s) for s in data["shards"]},
                total_shards=data["total_shards"],
            )
        except (KeyError, TypeError, ValueError) as error:
            raise UserError(
                f"{path} was edited or damaged: a field is missing or malformed ({error!r})"
            ) from None
        if manifest.fingerprint != data.get("fingerprint"):
            raise UserError(
                f"{path} was edited: its identity no longer hashes to its fingerprint "
                f"{data.get('fingerprint')!r}; restore it or start a new store"
            )
        _check_entries(path, listed)
        for index in manifest.shards:
            beyond = manifest.total_shards is not None and index >= manifest.total_shards
            if not manifest.owns(index) or beyond:
                raise UserError(
                    f"{path} was edited: it lists shard {index}, which is not one of this part's shards"
                )
        _check_hooks(path, manifest)
        manifest.recorded_totals = {name: data.get(name) for name in _TOTALS}
        return manifest

    def edited_totals(self) -> list[str]:
        """``"name=recorded, its shards add up to actual"`` for each total that does not fit
        the shard entries as loaded (empty for a manifest built in memory)."""
        return [
            f"{name}={value!r}, its shards add up to {getattr(self, name)!r}"
            for name, value in self.recorded_totals.items()
            if value != getattr(self, name)
        ]

    def check_shards(self, folder: Path, *, checksum: bool) -> None:
        """Check every recorded shard in ``folder`` against its entry (``check_shard``; the
        SHA-256 only when ``checksum``), then the totals (``check_totals``).

        Raises:
            UserError: The first shard or total that does not fit, and how to recover.
        """
        for record in self.shards.values():
            check_shard(folder, record, self.fingerprint, checksum=checksum)
        self.check_totals(folder)

    def check_totals(self, folder: Path) -> None:
        """Refuse totals that do not fit the entries; call it once the entries are checked
        against their shards (``check_shard``), whose messages name the edited entry.

        Raises:
            UserError: A total was edited.
        """
        edited = self.edited_totals()
        if edited:
            raise UserError(
                f"{folder / MANIFEST} was edited: it records {'; '.join(edited)}; restore it, or "
                f"rerun the capture with --repair to rewrite it"
            )


def _check_entries(path: Path, listed: list[int]) -> None:
    """Refuse shard entries out of index order or listed twice (the writer lists each once, in order)."""
    for before, after in itertools.pairwise(listed):
        if after == before:
            raise UserError(
                f"{path} was edited: it lists shard {after} twice; restore the manifest"
            )
        if after < before:
            raise UserError(
                f"{path} was edited: it lists shard {before} before shard {after}, but tl writes the "
                f"entries in index order; restore the manifest"
            )


def _check_hooks(path: Path, manifest: Manifest) -> None:
    """Refuse hook records that differ from the identity (which the fingerprint covers)."""
    wanted = manifest.identity.get("hooks")
    if not isinstance(wanted, dict):
        return
    recorded = {name: [h.requested, list(h.shape), h.dtype] for name, h in manifest.hooks.items()}
    for name in sorted(set(wanted) | set(recorded)):
        if recorded.get(name) != wanted.get(name):
            raise UserError(
                f"{path} was edited: hooks.{name} records {recorded.get(name)!r}, the identity "
                f"{wanted.get(name)!r}; restore the manifest"
            )


def identity_differences(
    recorded: Mapping[str, Any], requested: Mapping[str, Any], prefix: str = ""
) -> list[str]:
    """``"key: recorded -> requested"`` for every leaf that differs between two identities."""
    out: list[str] = []
    for key in sorted(set(recorded) | set(requested)):
        a, b = recorded.get(key), requested.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(identity_differences(a, b, f"{name}."))
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out
