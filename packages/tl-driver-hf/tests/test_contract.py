"""The hf driver keeps the Driver contract ``check_driver`` runs: hooks, specs, generation and
sampling (each option changes what is generated as it promises)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tl_core import TransformerBridge
from tl_core.driver_api import check_driver


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_hf_driver_keeps_the_contract(
    bridge_of: Callable[[str], TransformerBridge], family: str
) -> None:
    check_driver(bridge_of(family).driver)
