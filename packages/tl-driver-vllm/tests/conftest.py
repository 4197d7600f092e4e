"""Shared fixtures: vLLM's caches and sockets in a temp folder, tiny checkpoints, engines.

The environment is set when this file is imported, before any test imports vLLM (vLLM
reads some of these variables when its modules load).
"""

from __future__ import annotations

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
os.environ["VLLM_CACHE_ROOT"] = str(_VLLM_TMP / "cache")
os.environ["VLLM_RPC_BASE_PATH"] = str(_VLLM_TMP / "rpc")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
(_VLLM_TMP / "rpc").mkdir()

# Test helpers (_tlv_*.py) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))


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
