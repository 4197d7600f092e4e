"""Shard files: safetensors written atomically, with their checksum, and checked on open.

A shard is written to a hidden temporary file, flushed to disk and renamed into place, so a
shard name on disk always holds a whole file; the manifest lists a shard only after that.
The file is a standard safetensors file (any safetensors reader opens it), written here
straight from the tensors' memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tl_core._errors import UserError
from tl_core.gguf._cache import file_sha256

__all__ = [
    "RECORD_FIELDS",
    "ROW_FIELDS",
    "ShardRecord",
    "check_shard",
    "file_sha256",
    "fsync_folder",
    "shard_name",
    "write_shard",
]

#: The one header metadata key of a shard; its value is JSON (fingerprint, shard number).
HEADER_KEY = "tl-capture"

#: Per-row arrays every shard holds next to the hooks: token id, document index (-1 for
#: inserted tokens), context number and position in the context.
ROW_FIELDS = ("tokens", "documents", "contexts", "positions")

#: Fields of a ``ShardRecord`` that the shard's header repeats (the shard number is under
#: ``"shard"``), so an edited manifest entry is caught without reading the shard's data.
RECORD_FIELDS = ("first_context", "contexts", "first_document", "last_document", "tokens")


def shard_name(index: int) -> str:
    """The file name of shard ``index``."""
    return f"shard-{index:06d}.safetensors"


@dataclass(frozen=True)
class ShardRecord:
    """What the manifest knows of one complete shard.

    Attributes:
        index: The shard's number in the job.
        file: Its file name in the store folder.
        rows: Stored positions (rows of every hook tensor).
        first_context: The job number of its first context.
        contexts: How many contexts it holds.
        first_document: The first document it draws tokens from (-1: none).
        last_document: The last one.
        tokens: Model input tokens its contexts hold (stored or not).
        bytes: File size.
        sha256: Checksum of the file.
    """

    index: int
    file: str
    rows: int
    first_context: int
    contexts: int
    first_document: int
    last_document: int
    tokens: int
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values."""
        return asdict(self)


def fsync_folder(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: safetensors dtype codes of the dtypes a shard holds.
_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[Any]:
    """The safetensors file as buffers: length, JSON header, then each tensor's bytes.

    Written straight from the tensors' memory (no serialised copy of the whole shard), in
    name order, with the header's keys sorted: the same tensors give the same bytes.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    buffers: list[Any] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        if tensor.dtype not in _DTYPE_CODES:
            raise UserError(f"cannot store {name!r}: dtype {tensor.dtype} has no safetensors code")
        raw = (
            tensor.reshape(-1).view(torch.uint8)
            if tensor.numel()
            else torch.empty(0, dtype=torch.uint8)
        )
        size = raw.numel()
        header[name] = {
            "dtype": _DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        buffers.append(raw.numpy().data)  # a view of the tensor's memory, no copy
        offset += size
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    return [struct.pack("<Q", len(text)), text, *buffers]


def write_shard(
    folder: Path,
    index: int,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    summary: dict[str, int],
) -> ShardRecord:
    """Write one shard atomically and return its record.

    Args:
        folder: The store folder.
        index: The shard's number.
        tensors: Hook tensors and ``ROW_FIELDS`` arrays, all with the same number of rows.
        metadata: Stored in the file's header as one JSON string under ``"tl-capture"``,
            together with ``summary``.
        summary: ``first_context``, ``contexts``, ``first_document``, ``last_document``,
            ``tokens`` of the shard (``RECORD_FIELDS``).
    """
    header = {**metadata, **{name: int(summary[name]) for name in RECORD_FIELDS}}
    buffers = _encode(tensors, {HEADER_KEY: json.dumps(header, sort_keys=True)})
    name = shard_name(index)
    temporary = folder / f".{name}.partial"
    sha = hashlib.sha256()
    size = 0
    try:
        with temporary.open("wb") as handle:
            for buffer in buffers:
                handle.write(buffer)
                sha.update(buffer)
                size += len(buffer) if isinstance(buffer, bytes) else buffer.nbytes
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        temporary.unlink(missing_ok=True)  # give the space back (a full disk, most likely)
        raise
    os.replace(temporary, folder / name)
    fsync_folder(folder)
    return ShardRecord(
        index=index,
        file=name,
        rows=int(tensors["tokens"].shape[0]),
        bytes=size,
        sha256=sha.hexdigest(),
        **summary,
    )


def _edited(where: str, field: str, recorded: Any, actual: Any) -> UserError:
    return UserError(
        f"{where}: the manifest records {field}={recorded!r} but the shard's own header records "
        f"{field}={actual!r}: the manifest was edited; restore it, or rerun the capture with "
        f"--repair to redo the shard"
    )


def check_shard(folder: Path, record: ShardRecord, fingerprint: str, *, checksum: bool) -> None:
    """Refuse a shard that is missing, truncated, altered or from another store, or a manifest
    entry that does not describe it.

    Every field of ``record`` is checked: the file name against the shard number; the shard
    number, row count and ``RECORD_FIELDS`` against the file's header; the size against the
    file; the checksum only when ``checksum`` (it reads the whole file). The header is part
    of the checksummed bytes, so with ``checksum`` nothing in the entry is taken on trust.

    Raises:
        UserError: What is wrong with the shard or its entry, and how to recover.
    """
    from safetensors import safe_open

    path = folder / record.file
    where = f"store {folder}: shard {record.index} ({record.file})"
    if record.file != shard_name(record.index):
        raise UserError(
            f"{where}: the manifest records file={record.file!r}, but shard {record.index}'s file is "
            f"{shard_name(record.index)!r}: the manifest was edited (entries swapped?); restore it, or "
            f"rerun the capture with --repair to redo the shard"
        )
    if not path.is_file():
        raise UserError(
            f"{where} is listed in the manifest but missing; rerun the capture with --repair to redo it"
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = json.loads((handle.metadata() or {}).get(HEADER_KEY, "{}"))
            found = header.get("fingerprint")
            rows = handle.get_slice("tokens").get_shape()[0]
    except Exception as error:  # safetensors raises its own error types for a damaged header
        raise UserError(
            f"{where} is not a readable safetensors file ({error}): it was truncated or "
            f"overwritten; rerun the capture with --repair to redo it"
        ) from None
    if found != fingerprint:
        raise UserError(
            f"{where} belongs to another capture (fingerprint {found}, this store's "
            f"{fingerprint}): a shard from another model or configuration was copied in; "
            f"rerun the capture with --repair to redo it"
        )
    number = header.get("shard")
    if str(number) != str(record.index):
        raise _edited(
            where, "index", record.index, int(number) if str(number).isdigit() else number
        )
    if rows != record.rows:
        raise UserError(
            f"{where} holds {rows} rows, the manifest says {record.rows}: the manifest was "
            f"edited; restore it, or rerun the capture with --repair to redo the shard"
        )
    for name in RECORD_FIELDS:
        if name not in header:
            raise UserError(
                f"{where}: its header records no {name} (an earlier tl-core wrote it), so the "
                f"manifest's {name}={getattr(record, name)!r} cannot be checked; rerun the capture "
                f"with --repair to rewrite the shard"
            )
        if header[name] != getattr(record, name):
            raise _edited(where, name, getattr(record, name), header[name])
    size = path.stat().st_size
    if size != record.bytes:
        raise UserError(
            f"{where} has {size} bytes, the manifest says {record.bytes}: it was truncated or "
            f"replaced; rerun the capture with --repair to redo it"
        )
    if checksum and file_sha256(path) != record.sha256:
        raise UserError(
            f"{where} does not match its checksum in the manifest: its content changed; "
            f"rerun the capture with --repair to redo it"
        )
