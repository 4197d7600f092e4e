"""The worker side never imports the driver side; shared modules import neither.

vLLM imports ``tl_driver_vllm._worker_side`` inside every worker process. A worker module that
imported the driver side would pull the engine-booting code (and its imports) into each
worker and blur which side a function runs on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tl_driver_vllm"
SHARED = ("_dictionaries.py", "_families.py", "_run_message.py", "_wire.py")


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
    planted = "def f():\n    from tl_driver_vllm._driver_side._driver import VLLMDriver\n"
    assert crossings(planted, ("tl_driver_vllm._driver_side",)) == [
        "tl_driver_vllm._driver_side._driver",
        "tl_driver_vllm._driver_side._driver.VLLMDriver",
    ]
    planted = "from tl_driver_vllm import _driver_side\n"
    assert crossings(planted, ("tl_driver_vllm._driver_side",)) == ["tl_driver_vllm._driver_side"]
    assert (
        crossings("from tl_driver_vllm._wire import pack\n", ("tl_driver_vllm._driver_side",)) == []
    )


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "_worker_side").glob("*.py")), ids=lambda p: f"_worker_side/{p.name}"
)
def test_worker_modules_never_import_the_driver_side(path: Path) -> None:
    assert crossings(path.read_text(), ("tl_driver_vllm._driver_side",)) == []


@pytest.mark.parametrize("name", SHARED)
def test_shared_modules_import_neither_side(name: str) -> None:
    source = (PACKAGE / name).read_text()
    assert crossings(source, ("tl_driver_vllm._driver_side", "tl_driver_vllm._worker_side")) == []


def test_every_module_sits_on_one_side_or_is_shared() -> None:
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == {"__init__.py", "_version.py", *SHARED}
    assert (PACKAGE / "_driver_side" / "_driver.py").is_file()
    assert (PACKAGE / "_worker_side" / "_worker.py").is_file()
