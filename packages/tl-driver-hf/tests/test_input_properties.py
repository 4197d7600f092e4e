"""The input-surface properties of tl-core's suite, on the hf driver (tiny Llama and GPT-2).

Specs, hook names and token inputs drawn by hypothesis: each runs and equals a reference
computed another way, or is refused with a tl ``UserError`` before the forward starts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tl_core import TransformerBridge

_file = Path(__file__).parents[2] / "tl-core" / "tests" / "test_input_properties.py"
_spec = importlib.util.spec_from_file_location("_tl_core_input_properties", _file)
assert _spec is not None and _spec.loader is not None
_properties = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_properties)

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def hf_bridge(
    request: pytest.FixtureRequest, checkpoint: Callable[[str], Path]
) -> TransformerBridge:
    return TransformerBridge.boot_transformers(str(checkpoint(request.param)))


@given(data=st.data())
@SETTINGS
def test_specs_run_as_written_or_are_refused_first(
    hf_bridge: TransformerBridge, data: st.DataObject
) -> None:
    _properties.check_spec_property(hf_bridge, data)


@given(data=st.data())
@SETTINGS
def test_hook_names_resolve_or_are_refused_first(
    hf_bridge: TransformerBridge, data: st.DataObject
) -> None:
    full: Any = hf_bridge.run_with_cache([[5, 6, 7, 8], [9, 10]], prepend_bos=False)[1]
    _properties.check_name_property(hf_bridge, data, full)


@given(data=st.data())
@SETTINGS
def test_token_inputs_run_or_are_refused_first(
    hf_bridge: TransformerBridge, data: st.DataObject
) -> None:
    _properties.check_token_property(hf_bridge, data)
