"""The vllm driver keeps the Driver contract ``check_driver`` runs on a real engine: every
served hook captured in a ragged batch, aliases, refusals, an edit at the listed positions
only, generation, and sampling (``do_sample``, ``seed``, ``top_k`` and ``top_p`` each change
what is generated as they promise)."""

from __future__ import annotations

from typing import Any

import pytest

from tl_core.driver_api import (
    CertifyingDriver,
    DescribingDriver,
    DictionaryDriver,
    ReadoutDriver,
    WeightFoldingDriver,
    check_driver,
)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_vllm_driver_keeps_the_contract(checkpoint: Any) -> None:
    pytest.importorskip("vllm")
    from _tlv_support import ENGINE_OPTIONS

    from tl_core import RemoteBridge

    with RemoteBridge.boot_vllm(checkpoint("llama"), dtype="float32", **ENGINE_OPTIONS) as bridge:
        check_driver(bridge.driver)
        # Its optional capabilities, each a Protocol it implements.
        for capability in (CertifyingDriver, DescribingDriver, ReadoutDriver, DictionaryDriver):
            assert isinstance(bridge.driver, capability), capability.__name__
        assert not isinstance(bridge.driver, WeightFoldingDriver)
