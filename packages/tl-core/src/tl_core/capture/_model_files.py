"""What a capture job's model is made of, as a digest the store's identity records.

The model's path and sizes do not identify it: a checkpoint whose weights are replaced by
others of the same shapes keeps both (and its safetensors headers), so a store that
recorded only those could mix rows of two models. The record below covers content:

* a **checkpoint folder**: a SHA-256 over the content of its weight files, of its
  tokenizer files and of its other files (config, generation config, code), each group
  separately so a refusal can say which changed. Only the folder's own files count (not
  sub-folders, which no driver loads from); documentation, images and hidden files do not;
* a **GGUF file**: a digest of the whole file (it holds weights, tokenizer and config);
* a **hub id**: what is known without a network: the revision asked for and the commit
  of the local snapshot it resolves to in the hub cache (a commit names its content).
  Checked again after the boot, which may download one;
* a **native preset**: the preset's name; its weights follow from the boot options
  (``seed``), which the identity records anyway.

A ``tokenizer`` boot option that names another folder or hub id is recorded the same way.
Each file is read once per job, in pieces hashed on every core (``_hash_all``): a file's
digest is its SHA-256 up to 64 MiB, else the SHA-256 of its pieces' SHA-256s.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tl_core._errors import UserError
from tl_core.gguf._cache import file_sha256

__all__ = [
    "MODEL_KEY",
    "comparable",
    "describe_model",
    "model_files",
    "model_mismatch",
    "refreshed",
    "resolved_path",
    "unrecorded",
]

#: The identity's key for the record.
MODEL_KEY = "model_files"

_LOG = logging.getLogger("tl_core.capture")

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz")
_TOKENIZER_NAMES = frozenset(
    {
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "spiece.model",
        "sentencepiece.bpe.model",
        "chat_template.jinja",
        "chat_template.json",
    }
)
_UNUSED_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf", ".lock")
_UNUSED_PREFIXES = ("license", "notice", "readme")
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: Boot options that pick a hub revision by another name than ``revision``.
_PICKS_REVISION = frozenset({"checkpoint_index", "checkpoint_value"})
#: The parts of a record, in the order a message names them.
_FIELDS = (
    "kind",
    "source",
    "file",
    "weights",
    "tokenizer",
    "config",
    "tokenizer_source",
    "revision",
    "commit",
)


def resolved_path(name: str) -> str:
    """``name`` as an absolute path when it names a local path (it exists, or is written as
    one: ``/x``, ``./x``, ``~/x``); otherwise unchanged (a hub id or a preset).

    A relative path means another model from another working folder, so the store records
    the absolute one.
    """
    from tl_core.driver_api._paths import looks_like_path

    expanded = os.path.expanduser(name)
    if looks_like_path(name) or os.path.exists(expanded):
        return str(Path(expanded).resolve())
    return name


def _group(name: str) -> str | None:
    """Which digest a folder's file counts in (``None``: it cannot change the computation)."""
    lower = name.lower()
    if (
        name.startswith(".")
        or lower.endswith(_UNUSED_SUFFIXES)
        or lower.startswith(_UNUSED_PREFIXES)
    ):
        return None
    if lower.startswith("tokenizer") or lower in _TOKENIZER_NAMES or lower.endswith(".tiktoken"):
        return "tokenizer"
    if lower.endswith(_WEIGHTS):
        return "weights"
    return "config"


#: Files are hashed in pieces of this size, several pieces at a time.
_PIECE = 64 * 2**20


def _piece_sha256(path: Path, offset: int, length: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        handle.seek(offset)
        while length > 0:
            block = handle.read(min(1 << 23, length))
            if not block:
                break
            digest.update(block)
            length -= len(block)
    return digest.hexdigest()


def _hash_all(paths: list[Path]) -> dict[Path, str]:
    """Each file's digest: its SHA-256 (``file_sha256``) when it fits one piece, else the
    SHA-256 of its pieces' SHA-256s, the pieces hashed in parallel (hashlib and reads
    release the GIL), so a checkpoint of one large file takes about its read time over
    the machine's cores rather than one core's hashing speed."""

    def one(task: tuple[Path, int, int]) -> str:
        path, offset, length = task
        try:
            return file_sha256(path) if offset < 0 else _piece_sha256(path, offset, length)
        except OSError as error:
            raise UserError(
                f"cannot read {str(path)!r} ({error.strerror or error}) to record which model "
                f"the store holds; make it readable by this user"
            ) from None

    tasks: dict[Path, list[tuple[Path, int, int]]] = {}
    for path in paths:
        try:
            size = path.stat().st_size
        except OSError as error:
            raise UserError(
                f"cannot read {str(path)!r} ({error.strerror or error}) to record which model "
                f"the store holds; make it readable by this user"
            ) from None
        whole = [(path, -1, size)]
        tasks[path] = (
            whole
            if size <= _PIECE
            else [(path, offset, _PIECE) for offset in range(0, size, _PIECE)]
        )
    flat = [task for pieces in tasks.values() for task in pieces]
    workers = min(len(flat), os.cpu_count() or 1, 16)
    if workers <= 1:
        done = [one(task) for task in flat]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="tl-model-digest") as pool:
            done = list(pool.map(one, flat))
    out: dict[Path, str] = {}
    for path, pieces in tasks.items():
        shas, done = done[: len(pieces)], done[len(pieces) :]
        out[path] = (
            shas[0] if len(shas) == 1 else hashlib.sha256("\n".join(shas).encode()).hexdigest()
        )
    return out


def _combined(files: Mapping[str, tuple[int, str]]) -> str | None:
    """One digest of named files (name, size and content), or ``None`` for no file."""
    if not files:
        return None
    digest = hashlib.sha256()
    for name in sorted(files):
        size, sha = files[name]
        digest.update(f"{name}\0{size}\0{sha}\n".encode())
    return digest.hexdigest()[:16]


def _folder_groups(folder: Path) -> dict[str, str | None]:
    """The folder's weights, tokenizer and config digests."""
    try:
        entries = sorted(p for p in folder.iterdir() if p.is_file())
    except OSError as error:
        raise UserError(
            f"cannot list {str(folder)!r} ({error.strerror or error}) to record which model the "
            f"store holds; make it readable by this user"
        ) from None
    counted = [(p, group) for p in entries if (group := _group(p.name)) is not None]
    digests = _hash_all([p for p, _ in counted])
    groups: dict[str, dict[str, tuple[int, str]]] = {"weights": {}, "tokenizer": {}, "config": {}}
    for path, group in counted:
        groups[group][path.name] = (path.stat().st_size, digests[path])
    return {name: _combined(files) for name, files in groups.items()}


def _hub_cache(options: Mapping[str, Any]) -> Path:
    """The hub cache folder the drivers download to (huggingface_hub's rule)."""
    for key in ("cache_dir", "download_dir"):
        if isinstance(options.get(key), str):
            return Path(options[key]).expanduser()
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _hub_commit(repo: str, revision: str | None, options: Mapping[str, Any]) -> str | None:
    """The commit of the local snapshot ``revision`` of ``repo`` resolves to, if cached."""
    wanted = revision or "main"
    folder = _hub_cache(options) / f"models--{repo.replace('/', '--')}"
    if _COMMIT.fullmatch(wanted):
        commit: str | None = wanted
    else:
        try:
            commit = (folder / "refs" / wanted).read_text().strip()
        except OSError:
            return None
    if commit is None or not (folder / "snapshots" / commit).is_dir():
        return None
    return commit


def _source_record(name: str, options: Mapping[str, Any], revision: str | None) -> dict[str, Any]:
    """The record of a model (or tokenizer) named ``name``."""
    path = Path(name)
    if os.path.isabs(name) and path.is_dir():
        return {"kind": "folder", "source": name, **_folder_groups(path)}
    if os.path.isabs(name) and path.is_file():
        sha = _hash_all([path])[path]
        return {"kind": "gguf", "source": name, "file": sha[:16]}
    if os.path.isabs(name):
        raise UserError(
            f"model {name!r} does not exist on this machine, so the store cannot record which "
            f"model it holds; fix the path"
        )
    return {
        "kind": "hub",
        "source": name,
        "revision": revision,
        "commit": _hub_commit(name, revision, options),
    }


def model_files(config: Any) -> dict[str, Any]:
    """The record of ``config``'s model (and its ``tokenizer`` option) for the identity.

    Args:
        config: The job (``CaptureConfig``; its ``model`` and a ``tokenizer`` option are
            absolute paths where they name local paths).

    Returns:
        JSON values: ``kind`` (``folder``, ``gguf``, ``hub`` or ``native``), ``source``
        and the digests (see the module docstring).

    Raises:
        UserError: A model file that cannot be read.
    """
    options: Mapping[str, Any] = config.boot_options
    if config.driver == "native":
        return {"kind": "native", "source": str(config.model)}
    model = str(config.model)
    gguf_file = options.get("gguf_file")
    if isinstance(gguf_file, str) and os.path.isdir(model):
        model = str(Path(model, gguf_file).resolve())
    revision = options.get("revision")
    record = _source_record(model, options, revision if isinstance(revision, str) else None)
    if record["kind"] == "hub" and revision is None and _PICKS_REVISION & set(options):
        # The driver turns a checkpoint option into a branch name tl-core does not know:
        # "main"'s snapshot would be the wrong one, so the record names none.
        record["commit"] = None
    tokenizer = options.get("tokenizer")
    if isinstance(tokenizer, str):
        other = _source_record(tokenizer, options, options.get("tokenizer_revision"))
        record["tokenizer_source"] = tokenizer
        record["tokenizer"] = other.get("tokenizer", other.get("file", other.get("commit")))
    return record


def comparable(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` names content (a hub id not in the local cache names none yet)."""
    return not (record.get("kind") == "hub" and record.get("commit") is None)


def refreshed(config: Any, before: Mapping[str, Any]) -> dict[str, Any]:
    """The record after the boot: a hub id is resolved again (the boot may have downloaded
    a snapshot, or a newer one); files were hashed before the boot and stand."""
    tokenizer = before.get("tokenizer_source")
    if before.get("kind") != "hub" and (tokenizer is None or os.path.isabs(tokenizer)):
        return dict(before)
    after = model_files(config)
    if not comparable(after):
        _LOG.warning(
            "tl capture: model %r has no snapshot in the hub cache %s, so the store records "
            "it by name only: a resume or merge cannot check that its weights are the same",
            after["source"],
            _hub_cache(config.boot_options),
        )
    return after


def describe_model(record: Mapping[str, Any]) -> str:
    """``record`` for a message: its source and digests."""
    kind = record.get("kind")
    source = record.get("source")
    if kind == "native":
        return f"native preset {source!r}"
    if kind == "gguf":
        parts = [f"file sha256 {record.get('file')}"]
    elif kind == "hub":
        commit = record.get("commit") or "not in the local hub cache"
        parts = [f"revision {record.get('revision') or 'main'}, snapshot {commit}"]
    else:
        parts = [
            f"{group} sha256 {record.get(group) or 'none'}"
            for group in ("weights", "tokenizer", "config")
        ]
    if "tokenizer_source" in record:
        parts.append(f"tokenizer from {record['tokenizer_source']!r}")
    return f"{source!r} ({', '.join(parts)})"


def model_mismatch(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """What differs between two records (``"they differ in the weights"``), or ``None``."""
    if dict(recorded) == dict(current):
        return None
    names = {
        "kind": "the kind of model",
        "source": "the path",
        "file": "the GGUF file's content",
        "weights": "the weights",
        "tokenizer": "the tokenizer",
        "config": "the config files",
        "tokenizer_source": "the tokenizer's source",
        "revision": "the hub revision",
        "commit": "the hub snapshot",
    }
    differ = [names[f] for f in _FIELDS if recorded.get(f) != current.get(f)] or ["the records"]
    return "they differ in " + (
        differ[0] if len(differ) == 1 else ", ".join(differ[:-1]) + " and " + differ[-1]
    )


def unrecorded(identity: Mapping[str, Any]) -> bool:
    """Whether ``identity`` was written before stores recorded their model's files."""
    return not isinstance(identity.get(MODEL_KEY), Mapping)
