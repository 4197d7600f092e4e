"""Shared fixtures: vLLM's caches and sockets in a temp folder, tiny checkpoints, engines.

The environment is set when this file is imported, before any test imports vLLM (vLLM
reads some of these variables when its modules load).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_VLLM_TMP = Path(tempfile.mkdtemp(prefix="tl-vllm-tests-"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: fast boots
# A cache the caller names (the nox session shares one between its suites and tutorials) is
# kept; otherwise one for this run.
os.environ.setdefault("VLLM_CACHE_ROOT", str(_VLLM_TMP / "cache"))
os.environ["VLLM_RPC_BASE_PATH"] = str(_VLLM_TMP / "rpc")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
(_VLLM_TMP / "rpc").mkdir()

# Test helpers (_tlv_*.py) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config: pytest.Config) -> None:
    _inspect_model_classes_in_process()
    _freeze_imported_objects()


def _freeze_imported_objects() -> None:
    """Leave the objects of vLLM's, torch's and transformers' modules out of garbage collection.

    vLLM collects garbage ten times per engine boot and close; each full collection walks
    every object of those imports (about half a second each here), and this suite boots over
    a hundred engines. Objects made after this point are collected as usual.
    """
    if importlib.util.find_spec("vllm") is None:
        return
    import transformers  # noqa: F401
    import vllm.entrypoints.llm  # noqa: F401

    gc.freeze()


def _inspect_model_classes_in_process() -> None:
    """Let vLLM read a model class's capabilities in this process instead of a new one.

    On a cache miss vLLM imports the model class in a fresh Python process (so that a GPU
    machine's parent process never initialises CUDA), which costs a whole vLLM import, about
    10 s here, for each of the 30-odd architectures these tests boot. On the CPU build there
    is no CUDA to protect, and the function run is the same, so the result is too. The engines
    themselves are untouched; without vLLM (or with a vLLM that moved this) nothing changes.
    """
    if importlib.util.find_spec("vllm") is None:
        return
    try:
        from vllm.model_executor.models import registry
        from vllm.platforms import current_platform
    except ImportError:
        return
    if current_platform.is_cpu() and callable(getattr(registry, "_run_in_subprocess", None)):
        registry._run_in_subprocess = lambda fn: fn()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_VLLM_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_tmp() -> Path:
    """The folder holding vLLM's cache and IPC sockets during the tests."""
    return _VLLM_TMP


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Path]]:
    """``checkpoint(family, dtype="float32", **overrides)``: a tiny random checkpoint folder
    (cached), with config fields ``overrides`` set."""
    testing = pytest.importorskip("tl_driver_hf.testing")
    made: dict[tuple[str, str, str], Path] = {}

    def make(family: str, dtype: str = "float32", **overrides: Any) -> Path:
        key = (family, dtype, repr(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{family}-{dtype}")
            made[key] = testing.write_tiny_checkpoint(
                family, folder, dtype=dtype, overrides=overrides
            )
        return made[key]

    yield make


@pytest.fixture(scope="session")
def default_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """``default_checkpoint(model_type)``: a tiny checkpoint of ``model_type``'s default
    transformers config, with heads vLLM's CPU attention runs (cached)."""
    testing = pytest.importorskip("tl_driver_hf.testing")
    made: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in made:
            folder = tmp_path_factory.mktemp(f"default-{model_type}")
            made[model_type] = testing.write_tiny_default_checkpoint(
                model_type, folder, sizes=testing.VLLM_TINY_SIZES
            )
        return made[model_type]

    yield make
