"""vLLM's caches and sockets in a temp folder, set before any test imports vLLM."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

_VLLM_TMP = Path(tempfile.mkdtemp(prefix="tl-sae-lens-tests-"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: fast boots
# A cache the caller names (the nox session shares one between its suites) is kept.
os.environ.setdefault("VLLM_CACHE_ROOT", str(_VLLM_TMP / "cache"))
os.environ["VLLM_RPC_BASE_PATH"] = str(_VLLM_TMP / "rpc")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("WANDB_MODE", "disabled")
(_VLLM_TMP / "rpc").mkdir()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_VLLM_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def engine_options() -> dict[str, Any]:
    """Small vLLM engine settings for tiny models on the CPU."""
    return {
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "max_model_len": 64,
        "kv_cache_memory_bytes": 32 * 2**20,
    }
