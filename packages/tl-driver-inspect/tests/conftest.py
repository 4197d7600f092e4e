"""Shared fixtures: offline inspect, a tiny local checkpoint, the hf reference bridge."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["INSPECT_EVAL_CTL_SERVER"] = "false"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("INSPECT_LOG_LEVEL", "warning")
# For the vLLM provider tests (harmless without vLLM): engine in-process, caches and IPC
# sockets in a temp folder (vLLM reads these when its modules load).
_VLLM_TMP = Path(tempfile.mkdtemp(prefix="tl-inspect-vllm-"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# A cache the caller names (the nox session shares one between its suites) is kept.
os.environ.setdefault("VLLM_CACHE_ROOT", str(_VLLM_TMP / "cache"))
os.environ["VLLM_RPC_BASE_PATH"] = str(_VLLM_TMP / "rpc")
(_VLLM_TMP / "rpc").mkdir()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_VLLM_TMP, ignore_errors=True)


# Test helpers (_tli_*.py) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a chat template (local tokenizer)."""
    from tl_driver_hf.testing import write_tiny_checkpoint

    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="session")
def provider() -> str:
    """``tl_bridge``, unless another installed package claims that name (TransformerLens
    4.3 does), then the unambiguous ``tl_hf``."""
    from importlib.metadata import entry_points

    owners = {
        ep.value.split(".")[0] for ep in entry_points(group="inspect_ai") if ep.name == "tl_bridge"
    }
    return "tl_bridge" if owners <= {"tl_driver_inspect"} else "tl_hf"


@pytest.fixture(scope="session")
def reference(checkpoint: Path) -> Iterator[Any]:
    """The hf driver on the same checkpoint (the reference for outputs and activations)."""
    import tl_core

    bridge = tl_core.boot(str(checkpoint), driver="hf")
    yield bridge
    bridge.close()
