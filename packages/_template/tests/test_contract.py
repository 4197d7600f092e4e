"""The template driver keeps the Driver contract, and the bridge API works over it."""

from __future__ import annotations

import pytest
import torch

from tl_core import HookNameError, RemoteBridge, SpecError, UserError
from tl_core.driver_api import check_driver, get_driver_entry
from tl_driver_template import ENTRY, TemplateDriver


@pytest.fixture(scope="module")
def driver() -> TemplateDriver:
    return TemplateDriver.boot("llama", n_layers=2, seed=3)


def test_registered_under_its_name() -> None:
    assert get_driver_entry("template") == ENTRY


def test_keeps_the_driver_contract(driver: TemplateDriver) -> None:
    check_driver(driver)


def test_bridge_api_over_the_template() -> None:
    with RemoteBridge.boot("llama", driver="template", n_layers=2, seed=3) as bridge:
        logits, cache = bridge.run_with_cache(
            ["a template", "b"], names_filter=["blocks.1.hook_resid_post"]
        )
        assert cache["blocks.1.hook_out"].shape == (2, 11, bridge.cfg.d_model)
        assert cache.lengths == (11, 2)
        steer = {"blocks.0.hook_out": {"op": "add", "value": 3.0, "pos": -1}}
        edited = bridge("a template", intervene=steer)
        assert (edited[0, -1] - logits[0, 10]).abs().max() > 1e-3
        torch.testing.assert_close(edited[0, :-1], logits[0, :10])
        assert isinstance(bridge.generate("a template", max_new_tokens=3), str)


def test_refusals_name_what_was_wrong(driver: TemplateDriver) -> None:
    with pytest.raises(HookNameError, match="residual-stream sites only"):
        driver.forward([[1, 2]], capture=["blocks.0.attn.hook_pattern"])
    with pytest.raises(SpecError, match="read after the engine sampled"):
        driver.forward([[1, 2]], intervene={"unembed.hook_out": {"op": "suppress"}})
    with pytest.raises(UserError, match="beam_width"):
        driver.forward([[1, 2]], beam_width=2)
