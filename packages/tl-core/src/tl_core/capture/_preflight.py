"""Every check of a capture job that needs no model, made before any engine boots.

The output folders, the input (read once in full, which gives its digest), the specs'
structure, the dictionaries, the context size where the model's config is readable, the
model's files (hashed once, ``model_files``) and each store's configuration and model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tl_core._dictionaries._dictionary import SparseDictionary
from tl_core._errors import UserError
from tl_core.capture._checks import check_context_size, check_intervene, context_limit_before_boot
from tl_core.capture._config import CaptureConfig
from tl_core.capture._job import check_resumable
from tl_core.capture._lock import LOCK
from tl_core.capture._manifest import MANIFEST, Manifest
from tl_core.capture._model_files import model_files
from tl_core.capture._source import DocumentSource, open_source
from tl_core.sae._load import load_dictionary

__all__ = ["SPECS", "Preflight", "preflight"]

#: Where the specs come from, in messages.
SPECS = "intervene (--intervene, the specs applied while capturing)"

#: What a folder without a manifest may hold and still be a new store: the lock, partial
#: files and at most one shard (a first run stopped while writing its first shard).
_LEFTOVER_SHARDS = 1


def _check_output(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise UserError(
            f"output {folder} is a file; a capture store is a folder: choose a folder path"
        )
    if folder.is_dir() and not (folder / MANIFEST).exists():
        names = [p.name for p in folder.iterdir()]
        shards = [n for n in names if n.startswith("shard-") and n.endswith(".safetensors")]
        other = [
            n
            for n in names
            if n != LOCK and n not in shards and not (n.startswith(".") and n.endswith(".partial"))
        ]
        if other:
            shown = ", ".join(sorted(other)[:3]) + (", ..." if len(other) > 3 else "")
            raise UserError(
                f"{folder} is not empty and holds no capture store (it holds {shown}); choose a "
                f"new or empty folder"
            )
        if len(shards) > _LEFTOVER_SHARDS:
            raise UserError(
                f"{folder} holds {len(shards)} shard files but no {MANIFEST}, so its shards cannot be "
                f"checked or continued (was the manifest deleted?); restore {folder / MANIFEST}, or "
                f"choose a new or empty folder"
            )
    if (folder / MANIFEST).exists():
        Manifest.load(folder)  # a damaged manifest is reported before the model boots


@dataclass(frozen=True)
class Preflight:
    """What ``preflight`` read: the input, its digest, the dictionaries to attach, and the
    record of the model's files (``model_files``)."""

    source: DocumentSource
    digest: str
    dictionaries: list[SparseDictionary]
    model: dict[str, Any]


def preflight(config: CaptureConfig, folders: Sequence[tuple[Path, tuple[int, int]]]) -> Preflight:
    """Every check of a job that needs no model, for the stores ``folders`` (each with its
    part): the input (read once in full), the specs' structure, the dictionaries, the
    context size where the model's config is readable, the model's files (hashed once,
    see ``model_files``), and each store's configuration and model."""
    for folder, _ in folders:
        _check_output(folder)
    source = open_source(config.input, config.input_format, config.text_field)
    digest = source.digest()  # reads the whole input: empty, binary, not UTF-8, no text field
    check_intervene(config.intervene, SPECS)
    # A missing or inconsistent dictionary is refused before the boot; attached after it.
    dictionaries = [load_dictionary(entry["path"]) for entry in config.dictionaries]
    limit = context_limit_before_boot(config)
    if limit is not None:
        check_context_size(config, limit, booted=False)
    model = model_files(config)
    for folder, part in folders:
        check_resumable(folder, config, digest, part, model)
    return Preflight(source, digest, dictionaries, model)
