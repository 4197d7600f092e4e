"""Checks made before any driver process starts: driver names and model paths.

A driver process boots an engine for tens of seconds before it reports a typo; these checks
refuse a driver that is not installed (with "did you mean" and the install line), an engine
outside its tested range, and a model path that does not exist, in one line, up front.
"""

from __future__ import annotations

import os
from typing import Any

from tl_core import DriverLoadError, DriverNotFoundError
from tl_core.driver_api import checked_path

__all__ = ["check_driver", "check_model"]


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


def check_model(model: Any) -> None:
    """Refuse a model written as a path that cannot load (``tl_core.driver_api.checked_path``).

    Args:
        model: What the drivers will load: a folder, a ``.gguf`` file, a hub id or preset.

    Raises:
        UserError: ``model`` is written as a path and nothing is there, or it is an existing
            file that is no ``.gguf`` file.
    """
    if isinstance(model, (str, os.PathLike)) and not isinstance(os.fspath(model), bytes):
        checked_path(model, "model")
