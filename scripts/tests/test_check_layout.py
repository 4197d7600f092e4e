"""The package layout check holds on the repository and fails on planted wrong imports."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import check_layout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of every package's pyproject.toml and sources, to plant imports in."""
    for pyproject in (check_layout.ROOT / "packages").glob("*/pyproject.toml"):
        target = tmp_path / "packages" / pyproject.parent.name
        target.mkdir(parents=True)
        shutil.copy(pyproject, target / "pyproject.toml")
        shutil.copytree(
            pyproject.parent / "src", target / "src", ignore=shutil.ignore_patterns("__pycache__")
        )
    return tmp_path


def _plant(repo: Path, package: str, code: str) -> Path:
    module = next((repo / "packages" / package / "src").iterdir())
    planted = module / "_planted.py"
    planted.write_text(code)
    return planted


def test_the_repository_holds() -> None:
    assert check_layout.problems() == []
    names = {p.name for p in check_layout.packages()}
    assert {"tl-core", "tl-driver-hf", "tl-driver-vllm", "tl-driver-inspect", "tl-parity"} <= names


def test_the_copy_holds(repo: Path) -> None:
    assert check_layout.problems(repo) == []


def test_a_sideways_import_fails(repo: Path) -> None:
    _plant(repo, "tl-driver-hf", "from tl_driver_template import ENTRY\n")
    (problem,) = check_layout.problems(repo)
    assert "tl_planted" not in problem and "_planted.py:1" in problem
    assert "sideways" in problem and "tl-driver-hf imports tl_driver_template" in problem


def test_an_upward_import_inside_a_function_fails(repo: Path) -> None:
    _plant(repo, "tl-core", "def later():\n    import tl_parity\n")
    (problem,) = check_layout.problems(repo)
    assert "_planted.py:2" in problem and "upward" in problem


def test_a_private_import_fails_even_for_types(repo: Path) -> None:
    _plant(
        repo,
        "tl-driver-inspect",
        (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from tl_core.hooks._vocabulary import split_canonical\n"
            "from tl_core.hooks import _vocabulary\n"
        ),
    )
    problems = check_layout.problems(repo)
    assert len(problems) == 2 and all(
        "a private module of tl-core (_vocabulary)" in p for p in problems
    )
    assert "_planted.py:3" in problems[0] and "_planted.py:4" in problems[1]


def test_an_import_the_package_does_not_require_fails(repo: Path) -> None:
    pyproject = repo / "packages" / "tl-parity" / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('vllm = ["tl-driver-vllm>=0.1,<0.2"]\n', ""))
    problems = check_layout.problems(repo)
    assert problems and all("does not require tl-driver-vllm" in p for p in problems)


def test_a_package_on_no_floor_is_named(repo: Path) -> None:
    shutil.copytree(repo / "packages" / "_template", repo / "packages" / "other")
    pyproject = repo / "packages" / "other" / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace('name = "tl-driver-template"', 'name = "tl-other"')
    )
    (problem,) = check_layout.problems(repo)
    assert "on no floor" in problem and "tl-other" in problem


def test_an_import_circle_is_reported_with_each_step(repo: Path) -> None:
    # A type-only import back into a module that imports this one closes a circle.
    source = next((repo / "packages" / "tl-driver-hf" / "src").iterdir())
    (source / "_planted.py").write_text("from tl_driver_hf._planted_back import X\n")
    (source / "_planted_back.py").write_text(
        "from typing import TYPE_CHECKING\nX = 1\nif TYPE_CHECKING:\n    from . import _planted\n"
    )
    found = [p for p in check_layout.problems(repo) if "circle" in p]
    assert len(found) == 1, found
    assert "tl_driver_hf._planted -> tl_driver_hf._planted_back" in found[0]
    assert "tl_driver_hf._planted_back -> tl_driver_hf._planted" in found[0]
    assert "_planted_back.py:4" in found[0]


def test_a_submodule_imported_from_its_package_is_no_circle(repo: Path) -> None:
    # ``from package import submodule`` in a sibling imports the submodule, not the package's
    # __init__ back; the __init__ importing its submodules is no circle.
    source = next((repo / "packages" / "tl-driver-hf" / "src").iterdir())
    (source / "_planted.py").write_text("from tl_driver_hf import _planted_leaf\n")
    (source / "_planted_leaf.py").write_text("Y = 2\n")
    assert [p for p in check_layout.problems(repo) if "circle" in p] == []
