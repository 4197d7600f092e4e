"""The ``--model`` argument of ``tl`` commands: which driver it means, and whether it can load.

One rule, shared by every command that boots a model, for when ``--driver`` is not given:

* an existing folder, a ``.gguf`` file, or a name with ``/`` (``org/name``, ``./x``) is
  for the ``hf`` driver;
* a native preset (``gpt2``, ``llama``) is for the ``native`` driver;
* anything else is refused: a bare hub id (``distilgpt2``) needs ``--driver hf``.

A name written as a path must exist, and a file must be a ``.gguf`` file
(``tl_core.driver_api.checked_path``); an existing folder must hold a model, not nothing
or a sparse dictionary (``tl_core.driver_api.checked_model_folder``): all are checked here,
before any driver is imported, whatever the driver. What a driver's format needs inside
a model folder (``config.json``, weights) the driver checks.
"""

from __future__ import annotations

import os

from tl_core._errors import UserError
from tl_core.driver_api import checked_model_folder, checked_path

__all__ = ["check_model", "default_driver"]


def check_model(model: str) -> str:
    """``model`` with ``~`` expanded, after refusing a path that cannot load
    (``tl_core.driver_api.checked_path``, the rule the drivers use) and a folder that holds
    no model (``tl_core.driver_api.checked_model_folder``).

    Raises:
        UserError: A path that does not exist (naming the nearest folder that does), an
            existing file that is no ``.gguf`` file (naming the folder that holds it), an
            empty folder, or a sparse dictionary's folder.
    """
    name = checked_path(model, "--model")
    if os.path.isdir(name):
        checked_model_folder(name, "--model", needs_config=False)
    return name


def _native_presets() -> list[str]:
    from tl_core.native._config import PRESETS

    return sorted(PRESETS)


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
