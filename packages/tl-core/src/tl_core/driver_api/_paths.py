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
refused with the folder that holds it. An existing folder that holds no model
(``checked_model_folder``: an empty folder, a sparse dictionary's folder, a folder without
``config.json``) is refused saying what it holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tl_core._errors import UserError

__all__ = ["checked_model_folder", "checked_path", "looks_like_path"]

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


#: The files of a sparse dictionary saved by sae-lens (``SAE.save_model``).
_DICTIONARY_FILES = ("cfg.json", "sae_weights.safetensors")


def _dictionary_model(folder: Path) -> str:
    """`` (its cfg.json names the model 'gpt2')``, or ``""`` when it names none."""
    try:
        cfg = json.loads((folder / "cfg.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    if not isinstance(cfg, dict):
        return ""
    metadata = cfg.get("metadata")
    model = (metadata if isinstance(metadata, dict) else {}).get("model_name") or cfg.get(
        "model_name"
    )
    return f" (its cfg.json names the model {model!r})" if isinstance(model, str) else ""


def checked_model_folder(folder: str, what: str, *, needs_config: bool = True) -> None:
    """Refuse an existing folder that holds no model checkpoint, saying what it holds.

    Args:
        folder: An existing folder passed as a model.
        what: The option or argument it came from (``"--model"``, ``"model_name"``).
        needs_config: Whether a checkpoint folder must hold ``config.json`` (transformers'
            layout); ``False`` refuses only folders that hold no model in any layout.

    Raises:
        UserError: An empty folder; a sparse dictionary's folder (sae-lens's ``cfg.json``
            and ``sae_weights.safetensors``), which attaches to a model instead; with
            ``needs_config``, a folder without ``config.json`` (naming a ``.gguf`` file
            it holds, or what it holds).
    """
    path = Path(folder)
    if not path.is_dir() or (path / "config.json").is_file():
        return
    found = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    if not found:
        raise UserError(f"{what}={folder!r} is an empty folder; a model loads from {_CHECKPOINT}")
    if any(name in found for name in _DICTIONARY_FILES):
        raise UserError(
            f"{what}={folder!r} is a sparse dictionary folder (sae-lens's "
            f"{' and '.join(_DICTIONARY_FILES)}), not a model{_dictionary_model(path)}. Boot "
            f"the model it was trained on and attach the dictionary to it: "
            f"`tl capture run --model MODEL --sae {folder} ...`, or "
            f"bridge.add_sae(tl_core.sae.load_dictionary({folder!r}))"
        )
    if not needs_config:
        return
    ggufs = [name for name in found if name.endswith(".gguf")]
    if ggufs:
        raise UserError(
            f"{what}={folder!r} has no config.json but holds the GGUF file "
            f"{ggufs[0]!r}{' (and others)' if len(ggufs) > 1 else ''}: pass the file itself, "
            f"{str(path / ggufs[0])!r}"
        )
    shown = ", ".join(found[:12]) + (f", ... ({len(found)} entries)" if len(found) > 12 else "")
    raise UserError(
        f"{what}={folder!r} has no config.json, so it is no checkpoint folder (it holds: "
        f"{shown}); a model loads from {_CHECKPOINT}"
    )
