"""GGUF files for drivers: find the file a user named, and dequantise it once into a cached folder.

A GGUF checkpoint holds quantised weights, the config and the tokenizer in one file.
transformers reads it (``gguf_file=``) but parses the whole file again on every load
(about a minute for SmolLM2-135M on two cores), and vLLM 0.32 has no GGUF loader at all.
``dequantized_gguf`` converts a file once into an ordinary safetensors checkpoint folder
(config, weights in the requested dtype, tokenizer) under ``gguf_cache_dir()``, keyed by
the file's content hash and the dtype, which every driver then boots like any folder.

The folder is written under a temporary name and renamed into place only when complete
(with a ``tl-gguf.json`` record listing every file and its size, written last), so an
interrupted conversion never leaves a folder a later boot trusts. Two processes converting
the same file at once both succeed; the first rename wins.

Duck-typed: tl-core does not import transformers; drivers pass the auto classes.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from tl_core._errors import UserError

__all__ = [
    "CACHE_ENV",
    "GGUF_RECORD",
    "dequantized_gguf",
    "file_sha256",
    "gguf_cache_dir",
    "gguf_source",
    "require_gguf_packages",
]

_LOG = logging.getLogger("tl_core.gguf")

#: Environment variable naming tl's cache folder (GGUF conversions go to its ``gguf/``).
CACHE_ENV = "TL_CACHE_DIR"
#: The record a complete conversion folder holds, written last.
GGUF_RECORD = "tl-gguf.json"
_MAGIC = b"GGUF"
_FORMAT = 1  # bump when the folder layout changes; older folders are then ignored


def gguf_cache_dir() -> Path:
    """Where converted GGUF folders live.

    ``$TL_CACHE_DIR/gguf`` when ``TL_CACHE_DIR`` is set, else ``$XDG_CACHE_HOME/tl/gguf``,
    else ``~/.cache/tl/gguf``. Each conversion is one folder; delete any of them (or the
    whole folder) to free the space: the next boot converts again.
    """
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser() / "gguf"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tl" / "gguf"


def gguf_source(model: Any, gguf_file: Any = None) -> Path | None:
    """The GGUF file a boot call names, or ``None`` when it names something else.

    Args:
        model: What the user passed as the model: a ``.gguf`` file, or (with
            ``gguf_file``) the folder holding it.
        gguf_file: The file's name inside ``model`` (as transformers' ``gguf_file=``).

    Returns:
        The file's absolute path, or ``None`` for a model that is no GGUF file.

    Raises:
        UserError: The file is missing or is not a GGUF file.
    """
    if gguf_file is None:
        if not isinstance(model, (str, os.PathLike)) or not os.fspath(model).endswith(".gguf"):
            return None
        path = Path(os.fspath(model))
        where = f"{os.fspath(model)!r}"
    else:
        if not isinstance(gguf_file, (str, os.PathLike)):
            raise UserError(
                f"gguf_file must be a file name, got {type(gguf_file).__name__}: {gguf_file!r}"
            )
        if model is None or not isinstance(model, (str, os.PathLike)):
            raise UserError(
                f"gguf_file={os.fspath(gguf_file)!r} names a file inside a folder: pass the folder "
                f"as the model, or pass the file's path as the model and drop gguf_file"
            )
        if not os.path.isdir(model):
            raise UserError(
                f"gguf_file={os.fspath(gguf_file)!r} needs the model to be the folder that holds "
                f"it, but {os.fspath(model)!r} is not a folder on this machine (GGUF files are "
                f"read from local disk)"
            )
        path = Path(os.fspath(model)) / os.fspath(gguf_file)
        where = f"gguf_file={os.fspath(gguf_file)!r} in folder {os.fspath(model)!r}"
    if not path.is_file():
        raise UserError(f"GGUF file {where} does not exist (looked for {str(path)!r})")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != _MAGIC:
        raise UserError(
            f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, a GGUF file with {_MAGIC!r}"
        )
    return path.resolve()


def require_gguf_packages(install_hint: str) -> None:
    """Fail early, before any conversion, when the packages transformers needs are missing.

    Args:
        install_hint: The command that installs them (the driver's extra).

    Raises:
        UserError: ``gguf`` or ``accelerate`` is not installed (names which, and the fix).
    """
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(
            f"loading a GGUF file needs the {' and '.join(repr(m) for m in missing)} "
            f"package{'s' if len(missing) > 1 else ''}, which transformers uses to read and "
            f"dequantise it; install with: {install_hint}"
        )


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's contents, read in 8 MiB chunks on every call.

    Nothing is remembered between calls: no key built from the file's metadata can vouch
    for its content. A rewrite in place with the same size keeps the path, inode and size,
    and lands on the same mtime and ctime when it falls within the file system's
    timestamp granularity (or when a copy restores the mtime), so a remembered digest
    would describe the old content. Hashing costs a fraction of a boot (about 0.1 s for
    SmolLM2's 98 MB GGUF file, see docs/capture.md).
    """
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 23), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _complete(folder: Path, sha256: str, dtype: str) -> bool:
    """Whether ``folder`` is a finished conversion of this file in this dtype."""
    try:
        record = json.loads((folder / GGUF_RECORD).read_text())
        files = record["files"]
        return (
            record.get("format") == _FORMAT
            and record.get("sha256") == sha256
            and record.get("dtype") == dtype
            and bool(files)
            and all((folder / name).stat().st_size == size for name, size in files.items())
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as error:
        return error.errno == errno.EPERM
    return True


def _remove_abandoned(cache: Path, key: str) -> None:
    """Partial folders of this key left by processes that died mid-conversion."""
    for partial in cache.glob(f".{key}.partial-*"):
        pid_text = partial.name.rsplit(".partial-", 1)[1].split("-", 1)[0]
        if not pid_text.isdigit() or not _alive(int(pid_text)):
            shutil.rmtree(partial, ignore_errors=True)


def dequantized_gguf(
    path: Path,
    *,
    dtype: torch.dtype,
    auto_model: Any,
    auto_tokenizer: Any,
    reason: str,
    cache_dir: Path | None = None,
) -> Path:
    """A checkpoint folder holding ``path`` dequantised to ``dtype``: cached, else converted now.

    The conversion loads the file with transformers (``gguf_file=``, which dequantises),
    moves the weights into a fresh model built from the same config (a GGUF-loaded model
    cannot be saved as it is) and saves that model and the file's tokenizer. The weights
    are exactly the ones transformers loads from the file in that dtype.

    Args:
        path: The GGUF file (from ``gguf_source``).
        dtype: The weights' dtype in the folder.
        auto_model: ``transformers.AutoModelForCausalLM`` (or a class with its
            ``from_pretrained``/``from_config``).
        auto_tokenizer: ``transformers.AutoTokenizer``.
        reason: Why the caller converts, for the log line (``"vLLM 0.32 has no GGUF
            loader"``).
        cache_dir: Where to keep the folder (default ``gguf_cache_dir()``).

    Returns:
        The folder (under ``cache_dir``).

    Raises:
        UserError: The cache folder cannot be written, or transformers cannot read the file
            (its message is included).
    """
    sha256 = file_sha256(path)
    dtype_name = _dtype_name(dtype)
    cache = cache_dir if cache_dir is not None else gguf_cache_dir()
    key = f"{path.stem}-{sha256[:16]}-{dtype_name}"
    final = cache / key
    if _complete(final, sha256, dtype_name):
        _LOG.info("tl: using the dequantised copy of %s in %s", path.name, final)
        return final
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"cannot create the GGUF cache folder {str(cache)!r} ({exc}); set {CACHE_ENV} to a "
            f"writable folder"
        ) from exc
    _remove_abandoned(cache, key)
    _LOG.warning(
        "tl: %s: %s, so it is dequantised once to %s safetensors in %s (set %s to move the "
        "cache; later boots reuse it)",
        path.name,
        reason,
        dtype_name,
        final,
        CACHE_ENV,
    )
    start = time.perf_counter()
    partial = cache / f".{key}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        partial.mkdir()
        _convert(path, partial, dtype, auto_model, auto_tokenizer)
        files = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file()}
        record = {
            "format": _FORMAT,
            "source": str(path),
            "sha256": sha256,
            "size": path.stat().st_size,
            "dtype": dtype_name,
            "files": files,
        }
        (partial / GGUF_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _publish(partial, final, sha256, dtype_name)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    _LOG.info("tl: dequantised %s in %.1fs", path.name, time.perf_counter() - start)
    return final


def _publish(partial: Path, final: Path, sha256: str, dtype: str) -> None:
    """Rename the finished folder into place; a concurrent finished copy wins the race."""
    if final.exists() and not _complete(final, sha256, dtype):
        # A folder by that name that is not a complete record (a user's hand edit, an older
        # format): move it out of the way first, never trust it.
        stale = final.with_name(f".{final.name}.stale-{uuid.uuid4().hex[:8]}")
        with contextlib.suppress(OSError):
            final.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        partial.rename(final)
    except OSError:
        if not _complete(final, sha256, dtype):
            raise


def _convert(
    path: Path, out: Path, dtype: torch.dtype, auto_model: Any, auto_tokenizer: Any
) -> None:
    folder, name = str(path.parent), path.name
    try:
        tokenizer = auto_tokenizer.from_pretrained(folder, gguf_file=name)
        loaded = auto_model.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise UserError(
            f"transformers cannot load the GGUF file {str(path)!r}: {type(exc).__name__}: {exc}"
        ) from exc
    config = copy.deepcopy(loaded.config)
    # The config of a GGUF-loaded model says its weights are GGUF-quantised; the saved
    # folder holds plain dequantised tensors.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        fresh = auto_model.from_config(config, dtype=dtype)
    fresh.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    fresh.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
