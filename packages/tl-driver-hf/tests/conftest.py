"""Shared fixtures: tiny offline checkpoints of every family, bridges and eager references.

Checkpoints are written once per session into a temporary folder with
``tl_driver_hf.testing.write_tiny_checkpoint``; nothing touches the network.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from tl_core import TransformerBridge
from tl_driver_hf.testing import write_tiny_checkpoint

# Tests are imported in importlib mode, so the sibling table is loaded by path.
_spec = importlib.util.spec_from_file_location("_hf_paths", Path(__file__).with_name("_paths.py"))
assert _spec is not None and _spec.loader is not None
_paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_paths)
PATHS: dict[str, dict[str, Any]] = _paths.PATHS
FAMILIES: tuple[str, ...] = _paths.FAMILIES


@pytest.fixture(autouse=True, scope="session")
def _offline() -> Iterator[None]:
    # The hub reads the variable once at import, so its constant is patched as well: any
    # attempt to reach the network during a test then fails.
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hf_logging.disable_progress_bar()
    # Tiny models run many times faster on one thread than with threads contending.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    patch.undo()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session folder holding the tiny checkpoints."""
    return tmp_path_factory.mktemp("tiny-hf")


@pytest.fixture(scope="session")
def checkpoint(checkpoint_root: Path) -> Callable[[str], Path]:
    """``checkpoint(family)`` -> the folder of a float32 tiny checkpoint (written once)."""
    written: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in written:
            written[family] = write_tiny_checkpoint(family, checkpoint_root / family)
        return written[family]

    return get


@pytest.fixture(scope="session")
def bridge_of(checkpoint: Callable[[str], Path]) -> Callable[[str], TransformerBridge]:
    """``bridge_of(family)`` -> a cached bridge with ``use_attn_result=True``."""
    cache: dict[str, TransformerBridge] = {}

    def get(family: str) -> TransformerBridge:
        if family not in cache:
            cache[family] = TransformerBridge.boot_transformers(
                str(checkpoint(family)), use_attn_result=True
            )
        return cache[family]

    return get


@pytest.fixture(scope="session")
def reference_of(checkpoint: Callable[[str], Path]) -> Callable[[str], PreTrainedModel]:
    """``reference_of(family)`` -> the plain transformers model with eager attention."""
    cache: dict[str, PreTrainedModel] = {}

    def get(family: str) -> PreTrainedModel:
        if family not in cache:
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint(family), attn_implementation="eager"
            )
            cache[family] = model.eval()
        return cache[family]

    return get


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    """Each supported family in turn."""
    return str(request.param)


@pytest.fixture
def paths(family: str) -> dict[str, Any]:
    """The current family's module paths and flags (see ``PATHS``)."""
    return PATHS[family]


@pytest.fixture
def bridge(family: str, bridge_of: Callable[[str], TransformerBridge]) -> TransformerBridge:
    """The bridge of the current family."""
    return bridge_of(family)


@pytest.fixture
def reference(family: str, reference_of: Callable[[str], PreTrainedModel]) -> PreTrainedModel:
    """The eager transformers model of the current family."""
    return reference_of(family)


@pytest.fixture
def ids() -> torch.Tensor:
    """A batch of two random 11-token prompts (no padding)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(4, 500, (2, 11), generator=generator)
