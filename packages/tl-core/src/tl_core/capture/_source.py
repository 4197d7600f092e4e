"""Documents of a capture input, in a fixed order: a text file, JSONL, or a ``datasets`` folder."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tl_core._errors import UserError
from tl_core.capture._config import InputFormat

__all__ = ["Document", "DocumentSource", "open_source"]


@dataclass(frozen=True)
class Document:
    """One document: its index in the input, its text, and how far into the input it ends.

    ``progress`` is the fraction of the input read once this document is (bytes for files,
    rows for datasets), for the ETA.
    """

    index: int
    text: str
    progress: float


class DocumentSource:
    """The documents of one input, read lazily; ``digest`` identifies the input's content."""

    def __init__(self, path: Path, fmt: InputFormat, field: str) -> None:
        self.path, self.format, self.field = path, fmt, field
        self._dataset: Any = None
        if fmt == "datasets":
            self._dataset = _load_dataset(path)
            if field not in self._dataset.column_names:
                raise UserError(
                    f"the dataset at {path} has no column {field!r} (columns: "
                    f"{self._dataset.column_names}); pass text_field= (--text-field) naming "
                    f"the text column"
                )

    def digest(self) -> str:
        """A hash of the input's content (the dataset's fingerprint for a ``datasets`` folder)."""
        if self._dataset is not None:
            return f"datasets:{self._dataset._fingerprint}"
        sha = hashlib.sha256()
        with self.path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                sha.update(chunk)
        return f"sha256:{sha.hexdigest()}"

    def __iter__(self) -> Iterator[Document]:
        if self._dataset is not None:
            rows = len(self._dataset)
            for index, row in enumerate(self._dataset):
                yield Document(index, _text(row.get(self.field), self.path, index, self.field), (index + 1) / rows)
            return
        size = max(self.path.stat().st_size, 1)
        read = 0
        with self.path.open("rb") as handle:
            for index, raw in enumerate(handle):
                read += len(raw)
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as error:
                    raise UserError(f"{self.path}, line {index + 1}: not UTF-8 ({error.reason})") from None
                if self.format == "jsonl":
                    text = _json_text(line, self.path, index, self.field)
                else:
                    text = line
                yield Document(index, text, read / size)


def _text(value: object, path: Path, index: int, field: str) -> str:
    if not isinstance(value, str):
        raise UserError(
            f"{path}: document {index} has {type(value).__name__} in field {field!r}, not text"
        )
    return value


def _json_text(line: str, path: Path, index: int, field: str) -> str:
    if not line.strip():
        return ""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UserError(f"{path}, line {index + 1}: not JSON ({error.msg}); JSONL needs one object per line") from None
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(
            f"{path}, line {index + 1}: no field {field!r} (found {keys}); pass text_field= "
            f"(--text-field) naming the text field"
        )
    return _text(record[field], path, index, field)


def _load_dataset(path: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"{path} is a folder, read as a `datasets` dataset, and the datasets package is not "
            f"installed: pip install datasets"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        raise UserError(
            f"{path} holds a DatasetDict with splits {list(loaded)}; point input at one split's "
            f"folder (e.g. {path / next(iter(loaded))})"
        )
    return loaded


def open_source(path: str | Path, fmt: InputFormat | None, field: str) -> DocumentSource:
    """The documents of ``path``; the format is guessed from the path when ``fmt`` is ``None``.

    Raises:
        UserError: A missing input, or a format the path does not fit.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"input {path} does not exist")
    if fmt is None:
        fmt = "datasets" if path.is_dir() else "jsonl" if path.suffix == ".jsonl" else "text"
    if fmt != "datasets" and path.is_dir():
        raise UserError(f"input {path} is a folder; a {fmt} input is a file (a folder is read as a datasets dataset)")
    if fmt == "datasets" and not path.is_dir():
        raise UserError(f"input {path} is a file; a datasets input is the folder save_to_disk wrote")
    return DocumentSource(path, fmt, field)
