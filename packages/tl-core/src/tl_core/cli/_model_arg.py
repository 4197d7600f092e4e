"""The ``--model`` argument of ``tl`` commands: which driver it means, and whether it can load.

One rule, shared by every command that boots a model, for when ``--driver`` is not given:

* an existing folder, a ``.gguf`` file, or a name with ``/`` (``org/name``, ``./x``) is
  for the ``hf`` driver;
* a native preset (``gpt2``, ``llama``) is for the ``native`` driver;
* anything else is refused: a bare hub id (``distilgpt2``) needs ``--driver hf``.

A name written as a path (absolute, ``.``/``..``-relative, ``~``-relative; ``~`` is
expanded) must exist, and a file must be a ``.gguf`` file: both are checked here, before
any driver is imported, whatever the driver.
"""

from __future__ import annotations

import os
from pathlib import Path

from tl_core._errors import UserError

__all__ = ["check_model", "default_driver", "looks_like_path"]


def looks_like_path(model: str) -> bool:
    """Whether ``model`` is written as a path: absolute, ``.``/``..``-relative or ``~``-relative."""
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    return (
        os.path.isabs(model)
        or model in (".", "..")
        or model.startswith(tuple(dots + sep for dots in (".", "..") for sep in seps))
        or model.startswith("~")
    )


def _nearest_existing(path: Path) -> Path | None:
    return next((parent for parent in path.parents if parent.is_dir()), None)


def check_model(model: str) -> str:
    """``model`` with ``~`` expanded, after refusing a path that cannot load.

    Args:
        model: The ``--model`` argument.

    Returns:
        The argument, ``~`` expanded when it is written as a path.

    Raises:
        UserError: A path that does not exist (naming the nearest folder that does), or an
            existing file that is no ``.gguf`` file (naming the folder that holds it).
    """
    name = os.path.expanduser(model) if looks_like_path(model) else model
    gguf = name.endswith(".gguf")
    if os.path.isfile(name) and not gguf:
        folder = os.path.dirname(os.path.abspath(name))
        raise UserError(
            f"--model {model!r} is a file; drivers load a checkpoint folder (config.json, "
            f"weights, tokenizer files) or a .gguf file: pass the folder that holds it, "
            f"--model {folder!r}"
        )
    if looks_like_path(model) and not os.path.exists(name):
        absolute = Path(os.path.abspath(name))
        near = _nearest_existing(absolute)
        where = f"; the nearest folder that exists is {str(near)!r}" if near is not None else ""
        noun = "file" if gguf else "folder"
        raise UserError(
            f"--model {model!r} is a path, but {noun} {str(absolute)!r} does not exist{where}. "
            f"Fix the path, or pass a hub id (written 'name' or 'org/name', never starting "
            f"with '/', '.' or '~')"
        )
    return name


def _native_presets() -> list[str]:
    from tl_core.native._driver import _PRESETS

    return sorted(_PRESETS)


def default_driver(model: str) -> str:
    """The driver ``--model`` means when ``--driver`` is not given (the module's rule).

    Args:
        model: The ``--model`` argument.

    Returns:
        ``"hf"`` for an existing folder, a ``.gguf`` file or a name with ``/``;
        ``"native"`` for a native preset.

    Raises:
        UserError: A path that cannot load (see ``check_model``), or a name that is none
            of these (naming the presets, and ``--driver hf`` for a bare hub id).
    """
    name = check_model(model)
    if os.path.isdir(name) or name.endswith(".gguf") or "/" in name or os.sep in name:
        return "hf"
    presets = _native_presets()
    if name in presets:
        return "native"
    raise UserError(
        f"--model {model!r} is no folder, .gguf file, 'org/name' hub id or native preset "
        f"({', '.join(repr(p) for p in presets)}), so no driver can be chosen for it. For a "
        f"hub id without an organisation add --driver hf (e.g. --model {model!r} --driver hf); "
        f"`tl drivers` lists the others"
    )
