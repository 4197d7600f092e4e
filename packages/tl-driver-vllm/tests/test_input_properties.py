"""The input-surface properties of tl-core's suite, on a vLLM engine (tiny Llama).

Specs, hook names and token inputs drawn by hypothesis: each runs, or is refused with a tl
``UserError`` before the engine runs. A remote engine cannot run editing hooks, so a spec's
reference is the same edit made by hand on the hf driver; the tolerance is a semantics
check on a tiny random model (the numerics have their own band in ``test_parity.py``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import ENGINE_OPTIONS  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from tl_core import RemoteBridge, TransformerBridge  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_file = Path(__file__).parents[2] / "tl-core" / "tests" / "test_input_properties.py"
_spec = importlib.util.spec_from_file_location("_tl_core_input_properties", _file)
assert _spec is not None and _spec.loader is not None
_properties = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_properties)

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engines(checkpoint: Any) -> Iterator[tuple[RemoteBridge, TransformerBridge]]:
    folder = checkpoint("llama")
    remote = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_OPTIONS)
    try:
        yield remote, TransformerBridge.boot_transformers(str(folder))
    finally:
        remote.close()


@given(data=st.data())
@SETTINGS
def test_specs_run_as_written_or_are_refused_first(
    engines: tuple[RemoteBridge, TransformerBridge], data: st.DataObject
) -> None:
    remote, hf = engines
    _properties.check_spec_property(remote, data, reference=hf, tolerance=TOLERANCE)


@given(data=st.data())
@SETTINGS
def test_hook_names_resolve_or_are_refused_first(
    engines: tuple[RemoteBridge, TransformerBridge], data: st.DataObject
) -> None:
    remote = engines[0]
    full = remote.run_with_cache([[5, 6, 7, 8], [9, 10]], prepend_bos=False)[1]
    _properties.check_name_property(remote, data, full)


@given(data=st.data())
@SETTINGS
def test_token_inputs_run_or_are_refused_first(
    engines: tuple[RemoteBridge, TransformerBridge], data: st.DataObject
) -> None:
    _properties.check_token_property(engines[0], data, tolerance=TOLERANCE)
