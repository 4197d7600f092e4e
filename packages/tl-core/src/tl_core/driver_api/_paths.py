"""Model names that are paths: refused before anything loads when they cannot load.

transformers (and every tool built on it) reads a name that is no existing folder as a hub
id, so a mistyped path ends as "not a valid model identifier" from the hub, or offline as
a cache miss. One rule, shared by the drivers and the ``tl`` commands, decides from how a
name is written, with no look-up, what was meant:

* **a path**: absolute (``/models/x``), relative to ``.`` or ``..`` (``.``, ``./x``,
  ``../x``), relative to a home folder (``~``, ``~/x``; the ``~`` is expanded, which
  transformers does not do), or an ``os.PathLike`` object;
* **anything else** (``gpt2``, ``org/name``, ``models/x``) is a hub id unless it exists on
  disk, as transformers itself decides.

A path that does not exist is refused as such, naming the nearest folder that does; an
existing file that is no ``.gguf`` file (a ``config.json``, a ``model.safetensors``) is
refused with the folder that holds it.
"""

from __future__ import annotations

import os
from pathlib import Path

from tl_core._errors import UserError

__all__ = ["checked_path", "looks_like_path"]

_HUB_ID_FORM = "written 'name' or 'org/name', never starting with '/', '.' or '~'"
_CHECKPOINT = "a checkpoint folder (config.json, weights, tokenizer files) or a .gguf file"
_TOKENIZER = "a folder of tokenizer files (tokenizer.json, tokenizer_config.json) or a hub id"


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is written as a path (see the module docstring for the rule)."""
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    return (
        os.path.isabs(name)
        or name in (".", "..")
        or name.startswith(tuple(dots + sep for dots in (".", "..") for sep in seps))
        or name.startswith("~")
    )


def _nearest_existing(path: Path) -> Path | None:
    return next((parent for parent in path.parents if parent.is_dir()), None)


def checked_path(value: str | os.PathLike[str], what: str, *, gguf: bool = True) -> str:
    """``value`` as a string, ``~`` expanded, after refusing a path that cannot load.

    Args:
        value: A model (or tokenizer) name as the user passed it.
        what: The option or argument it came from, for the message (``"model_name"``,
            ``"tokenizer"``, ``"--model"``).
        gguf: Whether ``value`` names a model, which may be a ``.gguf`` file; ``False``
            for a tokenizer, which must be a folder or a hub id.

    Returns:
        The name, with ``~`` expanded when it is written as a path.

    Raises:
        UserError: A path that does not exist, or a file that is neither a folder nor
            (with ``gguf``) a ``.gguf`` file.
    """
    name = os.fspath(value)
    is_path = not isinstance(value, str) or looks_like_path(name)
    if is_path:
        name = os.path.expanduser(name)
    is_gguf = gguf and name.endswith(".gguf")
    if os.path.isfile(name) and not is_gguf:
        folder = os.path.dirname(os.path.abspath(name))
        raise UserError(
            f"{what}={os.fspath(value)!r} is a file, but a model loads from "
            f"{_CHECKPOINT if gguf else _TOKENIZER}: pass the folder that holds it, {folder!r}"
        )
    if is_path and not os.path.exists(name):
        absolute = Path(os.path.abspath(name))
        near = _nearest_existing(absolute)
        where = f"; the nearest folder that exists is {str(near)!r}" if near is not None else ""
        raise UserError(
            f"{what}={os.fspath(value)!r} is a path, but {'file' if is_gguf else 'folder'} "
            f"{str(absolute)!r} does not exist{where}. Fix the path, or pass a hub id "
            f"({_HUB_ID_FORM})"
        )
    return name
