"""Model and tokenizer names that are paths: refused before anything loads when they are wrong.

transformers reads a name that is no existing folder as a hub id, so a mistyped path ends
as "not a valid model identifier" from the hub (or, offline, a cache miss). The rule
here decides what was meant from how the name is written, with no look-up:

* **a path**: absolute (``/models/x``, ``C:\\models\\x``), relative to ``.`` or ``..``
  (``.``, ``./x``, ``../x``), relative to a home folder (``~``, ``~/x``, ``~user/x``; the
  ``~`` is expanded, which transformers does not do), or an ``os.PathLike`` object;
* **anything else** (``gpt2``, ``org/name``, ``models/x``) is a hub id unless it exists
  on disk, as transformers itself decides.

A path that does not exist is refused as such; an existing file that is no ``.gguf``
file (a ``config.json``, a ``model.safetensors``) is refused with the folder that holds it.
"""

from __future__ import annotations

import os
from pathlib import Path

from tl_core import UserError

__all__ = ["checked_path", "looks_like_path"]

_HUB_ID_FORM = "written 'name' or 'org/name', never starting with '/', '.' or '~'"


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
    for parent in path.parents:
        if parent.is_dir():
            return parent
    return None


def checked_path(value: str | os.PathLike[str], what: str, *, gguf: bool) -> str:
    """``value`` as a string, ``~`` expanded, after refusing a path that cannot load.

    Args:
        value: A model or tokenizer name as the user passed it.
        what: The option it came from, for the message (``"model_name"``, ``"tokenizer"``).
        gguf: Whether a ``.gguf`` file is a valid value; its existence and format are then
            left to ``tl_core.driver_api.gguf_source``, which names the file.

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
    if gguf and name.endswith(".gguf"):
        return name
    if os.path.isfile(name):
        folder = os.path.dirname(os.path.abspath(name))
        holds = (
            "a checkpoint folder (config.json, weights, tokenizer files) or a .gguf file"
            if gguf
            else "a folder of tokenizer files (tokenizer.json, tokenizer_config.json) or a hub id"
        )
        raise UserError(
            f"{what}={os.fspath(value)!r} is a file, but the hf driver reads {holds}: pass the "
            f"folder that holds it, {folder!r}"
        )
    if is_path and not os.path.exists(name):
        absolute = Path(os.path.abspath(name))
        near = _nearest_existing(absolute)
        where = f"; the nearest folder that exists is {str(near)!r}" if near is not None else ""
        raise UserError(
            f"{what}={os.fspath(value)!r} is a path, but folder {str(absolute)!r} does not "
            f"exist{where}. Fix the path, or pass a hub id ({_HUB_ID_FORM})"
        )
    return name
