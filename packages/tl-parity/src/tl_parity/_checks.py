"""Checks made before any driver process starts: driver names and model paths.

A driver process boots an engine for tens of seconds before it reports a typo; these checks
refuse a driver that is not installed (with "did you mean" and the install line), an engine
outside its tested range, and a model path that does not exist, in one line, up front.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tl_core._errors import DriverLoadError, DriverNotFoundError, UserError

__all__ = ["check_driver", "check_model", "looks_like_path"]


def check_driver(name: str, role: str) -> None:
    """Refuse a driver that is not installed, is broken, or whose engine is out of range.

    Args:
        name: The driver name (``"vllm"``).
        role: What the driver is for, for the message (``"candidate"``, ``"reference"``).

    Raises:
        DriverNotFoundError: Not installed; names the installed drivers and the closest
            name or the ``pip install`` line.
        DriverLoadError: Installed but broken, or its engine (``EngineVersionError``) is
            missing or outside the tested range; the message says what to install.
    """
    from tl_core.driver_api import get_driver_entry

    try:
        entry = get_driver_entry(name)
        if entry.engine is not None:
            entry.engine.check(name)
    except (DriverNotFoundError, DriverLoadError) as exc:
        raise type(exc)(f"the {role} driver {name!r} cannot run: {exc}") from exc


def looks_like_path(model: str) -> bool:
    """Whether ``model`` is spelled as a file-system path rather than a hub id or preset.

    Hub ids are ``name`` or ``org/name``; a path starts with ``/``, ``~`` or ``.``, has more
    than one ``/``, uses the platform's separator, or names a ``.gguf`` file.
    """
    if model.startswith(("/", "~", ".")) or os.path.isabs(model):
        return True
    return model.count("/") > 1 or (os.sep != "/" and os.sep in model) or model.endswith(".gguf")


def check_model(model: Any) -> None:
    """Refuse a model spelled as a path that does not exist on this machine.

    Args:
        model: What the drivers will load: a folder, a ``.gguf`` file, a hub id or preset.

    Raises:
        UserError: ``model`` looks like a path (see ``looks_like_path``) and nothing is there,
            or it is an existing file that is no ``.gguf`` file.
    """
    if not isinstance(model, (str, os.PathLike)):
        return
    text = os.fspath(model)
    if isinstance(text, bytes) or not (isinstance(model, os.PathLike) or looks_like_path(text)):
        return
    path = Path(text).expanduser()
    if path.is_file() and not text.endswith(".gguf"):
        raise UserError(
            f"model {text!r} is a file; drivers load a checkpoint folder (config.json, weights, "
            f"tokenizer files) or a .gguf file: pass the folder that holds it, {str(path.absolute().parent)!r}"
        )
    if path.exists():
        return
    what = "GGUF file" if text.endswith(".gguf") else "folder"
    parent = next((p for p in path.absolute().parents if p.is_dir()), None)
    # Name the deepest folder that does exist when the typo is further up than the last part.
    useful = parent is not None and parent not in (path.parent.absolute(), Path(parent.anchor))
    near = f"; the deepest folder that exists is {str(parent)!r}" if useful else ""
    raise UserError(
        f"model {what} {text!r} does not exist (looked for {str(path.absolute())!r}{near}); "
        f"pass an existing checkpoint {what}, or a hub id such as 'org/name'"
    )
