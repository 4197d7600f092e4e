"""Shared fixtures: tiny checkpoints (written once per session) and a quiet environment."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("INSPECT_EVAL_CTL_SERVER", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
_VLLM_TMP = Path(tempfile.mkdtemp(prefix="tl-parity-vllm-"))
# A cache the caller names (the nox session shares one between its suites) is kept.
os.environ.setdefault("VLLM_CACHE_ROOT", str(_VLLM_TMP / "cache"))
os.environ["VLLM_RPC_BASE_PATH"] = str(_VLLM_TMP / "rpc")
(_VLLM_TMP / "rpc").mkdir()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_VLLM_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """``tiny(family)``: a tiny random checkpoint folder of that family (cached per session)."""
    testing = pytest.importorskip("tl_driver_hf.testing", reason="pip install tl-driver-hf")
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            made[family] = testing.write_tiny_checkpoint(
                family, tmp_path_factory.mktemp(family) / family
            )
        return made[family]

    yield make
