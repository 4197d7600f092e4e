"""The worker side never imports the driver side; shared modules import neither.

vLLM imports ``tl_driver_vllm.worker`` inside every worker process. A worker module that
imported the driver side would pull the engine-booting code (and its imports) into each
worker and blur which side a function runs on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tl_driver_vllm"
SHARED = ("_dictionaries.py", "_families.py", "_wire.py")


def imported_modules(source: str) -> list[str]:
    """Every absolute module an ``import`` or ``from ... import`` names, nested ones too."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def crossings(source: str, forbidden: tuple[str, ...]) -> list[str]:
    """The imports of ``source`` that reach into any of the ``forbidden`` subpackages."""
    return [
        name
        for name in imported_modules(source)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def test_the_check_sees_a_planted_crossing() -> None:
    planted = "def f():\n    from tl_driver_vllm.driver._driver import VLLMDriver\n"
    assert crossings(planted, ("tl_driver_vllm.driver",)) == [
        "tl_driver_vllm.driver._driver",
        "tl_driver_vllm.driver._driver.VLLMDriver",
    ]
    planted = "from tl_driver_vllm import driver\n"
    assert crossings(planted, ("tl_driver_vllm.driver",)) == ["tl_driver_vllm.driver"]
    assert crossings("from tl_driver_vllm._wire import pack\n", ("tl_driver_vllm.driver",)) == []


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "worker").glob("*.py")), ids=lambda p: f"worker/{p.name}"
)
def test_worker_modules_never_import_the_driver_side(path: Path) -> None:
    assert crossings(path.read_text(), ("tl_driver_vllm.driver",)) == []


@pytest.mark.parametrize("name", SHARED)
def test_shared_modules_import_neither_side(name: str) -> None:
    source = (PACKAGE / name).read_text()
    assert crossings(source, ("tl_driver_vllm.driver", "tl_driver_vllm.worker")) == []


def test_every_module_sits_on_one_side_or_is_shared() -> None:
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == {"__init__.py", "_version.py", *SHARED}
    assert (PACKAGE / "driver" / "_driver.py").is_file()
    assert (PACKAGE / "worker" / "_worker.py").is_file()
