"""Documents of a capture input, in a fixed order: a text file, JSONL, or a ``datasets`` folder."""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from tl_core._errors import UserError
from tl_core.capture._config import InputFormat

__all__ = ["CHECKED_RECORDS", "Document", "DocumentSource", "open_source"]

#: JSONL records (and dataset rows) parsed in full before the model boots; every later
#: JSONL line is checked for the text field's name only.
CHECKED_RECORDS = 1000

_EXPECTED = {
    "text": "a text input holds one document per line, in UTF-8",
    "jsonl": "a JSONL input holds one JSON object per line, in UTF-8, its text under --text-field",
}


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
        self._digest: str | None = None
        if fmt == "datasets":
            self._dataset = _load_dataset(path)
            if field not in self._dataset.column_names:
                raise UserError(
                    f"the dataset at {path} has no column {field!r} (columns: "
                    f"{self._dataset.column_names}); pass text_field= (--text-field) naming "
                    f"the text column"
                )

    def digest(self) -> str:
        """A hash of the input's content (the dataset's fingerprint for a ``datasets`` folder),
        computed in the pass of ``check``."""
        if self._digest is None:
            self._digest = self.check()
        return self._digest

    def check(self) -> str:
        """Read the whole input once, refuse one that cannot be captured, and return its digest.

        A file must be non-empty UTF-8 text without NUL bytes, with at least one document;
        a JSONL file's first ``CHECKED_RECORDS`` records are parsed in full, and every later
        line must hold the text field's name (a line without it is parsed to make sure).
        A dataset must have rows, and its first rows text in the text column.

        Raises:
            UserError: What is wrong, where (line, byte offset or row), and how to fix it.
        """
        if self._dataset is not None:
            rows = len(self._dataset)
            if rows == 0:
                raise UserError(
                    f"the dataset at {self.path} has no rows, so there is nothing to capture; "
                    f"point input at a split that holds documents"
                )
            for index in range(min(rows, CHECKED_RECORDS)):
                _text(
                    self._dataset[index].get(self.field),
                    f"the dataset at {self.path}, row {index}",
                    self.field,
                )
            return f"datasets:{self._dataset._fingerprint}"
        if self.path.stat().st_size == 0:
            raise UserError(
                f"input {self.path} is empty (0 bytes), so there is nothing to capture; "
                f"{_EXPECTED[self.format]}. Point input (--input) at the corpus file"
            )
        scan = _Scan(self.path, self.format, self.field)
        try:
            with self.path.open("rb") as handle:
                if self.format == "jsonl":
                    for raw in handle:
                        scan.line(raw)
                else:
                    for chunk in iter(lambda: handle.read(1 << 22), b""):
                        scan.chunk(chunk)
        except OSError as error:
            raise UserError(
                f"cannot read input {self.path}: {error.strerror or error}; make it readable "
                f"by this user, or copy it somewhere that is"
            ) from None
        return scan.finish()

    def __iter__(self) -> Iterator[Document]:
        if self._dataset is not None:
            rows = len(self._dataset)
            for index, row in enumerate(self._dataset):
                where = f"the dataset at {self.path}, row {index}"
                yield Document(
                    index, _text(row.get(self.field), where, self.field), (index + 1) / rows
                )
            return
        size = max(self.path.stat().st_size, 1)
        read = 0
        with self.path.open("rb") as handle:
            for index, raw in enumerate(handle):
                read += len(raw)
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as error:
                    raise UserError(
                        f"input {self.path}, line {index + 1}: not UTF-8 ({error.reason}); "
                        f"{_EXPECTED[self.format]}. Convert it to UTF-8"
                    ) from None
                if self.format == "jsonl":
                    text = _json_text(line, self.path, index, self.field)
                else:
                    text = line
                yield Document(index, text, read / size)


class _Scan:
    """One pass over an input file: its SHA-256, and the checks ``DocumentSource.check`` makes."""

    def __init__(self, path: Path, fmt: InputFormat, field: str) -> None:
        self.path, self.format, self.field = path, fmt, field
        self.sha = hashlib.sha256()
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.offset = 0  # bytes before the current chunk or line
        self.lines = 0  # line breaks before it
        self.content = False  # whether a document with text was seen
        self.needles = {json.dumps(field).encode(), json.dumps(field, ensure_ascii=False).encode()}

    def chunk(self, data: bytes) -> None:
        """A block of a text file."""
        self.sha.update(data)
        self._binary(data)
        try:
            self.decoder.decode(data)
        except UnicodeDecodeError as error:
            # The decoder prepends the incomplete sequence it kept from the previous chunk.
            at = self.offset - (len(error.object) - len(data)) + error.start
            self._not_utf8(at, data[: max(at - self.offset, 0)].count(b"\n"), error.reason)
        if not self.content and data.strip(b"\r\n"):
            self.content = True
        self.offset += len(data)
        self.lines += data.count(b"\n")

    def line(self, raw: bytes) -> None:
        """One line of a JSONL file (with its line break)."""
        self.sha.update(raw)
        self._binary(raw)
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as error:
            self._not_utf8(self.offset + error.start, 0, error.reason)
        if self.lines < CHECKED_RECORDS or not any(n in raw for n in self.needles):
            # Parsed in full; a later line without the field's name is parsed to name the problem.
            if _json_text(line, self.path, self.lines, self.field):
                self.content = True
        elif line.strip():
            self.content = True
        self.offset += len(raw)
        self.lines += 1

    def finish(self) -> str:
        """The digest, once the whole file was read."""
        try:
            self.decoder.decode(b"", final=True)
        except UnicodeDecodeError as error:
            self._not_utf8(self.offset - len(error.object) + error.start, 0, error.reason)
        if not self.content:
            what = (
                "lines are all empty"
                if self.format == "text"
                else f"records hold no text in {self.field!r}"
            )
            raise UserError(
                f"input {self.path} holds no document to capture: its {self.lines} {what}; "
                f"{_EXPECTED[self.format]}"
            )
        return f"sha256:{self.sha.hexdigest()}"

    def _binary(self, data: bytes) -> None:
        at = data.find(b"\0")
        if at >= 0:
            line = self.lines + data[:at].count(b"\n") + 1
            raise UserError(
                f"input {self.path} is not text: byte {self.offset + at:,} (line {line}) is a NUL "
                f"byte, as in a binary or compressed file; {_EXPECTED[self.format]}. Decompress "
                f"or convert it, or point input (--input) at the text"
            )

    def _not_utf8(self, at: int, breaks: int, reason: str) -> NoReturn:
        raise UserError(
            f"input {self.path}, line {self.lines + breaks + 1} (byte {at:,}): not UTF-8 "
            f"({reason}); {_EXPECTED[self.format]}. Convert it, e.g. iconv -f latin1 -t utf-8 "
            f"{self.path.name} > {self.path.stem}.utf8{self.path.suffix}, and capture that"
        ) from None


def _text(value: object, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise UserError(
            f"{where}: field {field!r} holds {type(value).__name__} {str(value)[:40]!r}, not text; "
            f"make it a string, or pass text_field= (--text-field) naming the text field"
        )
    return value


def _json_text(line: str, path: Path, index: int, field: str) -> str:
    if not line.strip():
        return ""
    where = f"input {path}, line {index + 1}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UserError(
            f"{where}: not JSON ({error.msg} at column {error.colno}); JSONL needs one JSON "
            f"object per line, its text under --text-field {field!r}"
        ) from None
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(
            f"{where}: the record has no field {field!r} (found {keys}); give every record "
            f"its text under {field!r}, or pass text_field= (--text-field) naming the text field"
        )
    return _text(record[field], where, field)


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
        raise UserError(f"input {path} does not exist; check the path given as input (--input)")
    if fmt is None:
        fmt = "datasets" if path.is_dir() else "jsonl" if path.suffix == ".jsonl" else "text"
    if fmt != "datasets" and path.is_dir():
        raise UserError(
            f"input {path} is a folder; a {fmt} input is a file (a folder is read as a datasets dataset)"
        )
    if fmt == "datasets" and not path.is_dir():
        raise UserError(
            f"input {path} is a file; a datasets input is the folder save_to_disk wrote"
        )
    if fmt == "text" and field != "text":
        raise UserError(
            f"text_field={field!r} (--text-field) names a field of JSONL records or dataset "
            f"rows, but input {path} is read as text (one document per line), which has no "
            f"fields, so it would be ignored; drop it, or pass input_format='jsonl' "
            f"(--format jsonl) if the file holds JSON records"
        )
    return DocumentSource(path, fmt, field)
