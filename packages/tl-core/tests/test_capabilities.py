"""Optional capabilities are Protocols a driver implements, asked for with ``isinstance``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tl_core import TransformerBridge, UnsupportedFeatureError
from tl_core.driver_api import (
    CertifyingDriver,
    DescribingDriver,
    DictionaryDriver,
    ReadoutDriver,
    SplitQKVDriver,
    WeightFoldingDriver,
)
from tl_core.native import NativeDriver
from tl_core.sae import random_dictionary


def test_the_native_driver_declares_what_it_can_do() -> None:
    driver = NativeDriver.boot("gpt2", n_layers=1)
    assert isinstance(driver, ReadoutDriver) and isinstance(driver, SplitQKVDriver)
    for missing in (CertifyingDriver, DescribingDriver, DictionaryDriver, WeightFoldingDriver):
        assert not isinstance(driver, missing), missing.__name__
    bridge = TransformerBridge(driver)
    assert bridge.certification is None and bridge.architecture is None
    with pytest.raises(UnsupportedFeatureError, match="enable_compatibility_mode"):
        bridge.enable_compatibility_mode()


class _AttachOnly(NativeDriver):
    """Half a dictionary capability: it could attach, and never detach."""

    def attach_dictionary(self, attachment: Any) -> None:
        raise AssertionError("a driver that cannot detach must not be handed a dictionary")


def test_half_a_capability_is_not_the_capability() -> None:
    driver = _AttachOnly.boot("gpt2", n_layers=1)
    assert not isinstance(driver, DictionaryDriver)
    # Being a local driver, it still runs dictionaries: spliced into its hook tree.
    bridge = TransformerBridge(driver)
    splice = bridge.add_sae(
        random_dictionary(driver.info.d_model, 8, seed=0), hook_name="blocks.0.hook_out"
    )
    _, cache = bridge.run_with_cache(
        [[1, 2, 3]], names_filter=["blocks.0.hook_out.hook_sae_acts_post"]
    )
    assert cache["blocks.0.hook_out.hook_sae_acts_post"].shape == (1, 3, 8)
    assert torch.isfinite(cache["blocks.0.hook_out.hook_sae_acts_post"]).all()
    splice.remove()
