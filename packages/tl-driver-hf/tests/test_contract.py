"""The hf driver keeps the Driver contract ``check_driver`` runs: hooks, specs, generation and
sampling (each option changes what is generated as it promises)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tl_core import TransformerBridge
from tl_core.driver_api import (
    CertifyingDriver,
    DescribingDriver,
    DictionaryDriver,
    ReadoutDriver,
    WeightFoldingDriver,
    check_driver,
    validation_calls,
)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_hf_driver_keeps_the_contract(
    bridge_of: Callable[[str], TransformerBridge], family: str
) -> None:
    driver = bridge_of(family).driver
    check_driver(driver)
    # Its optional capabilities, each a Protocol it implements.
    for capability in (CertifyingDriver, DescribingDriver, ReadoutDriver, WeightFoldingDriver):
        assert isinstance(driver, capability), capability.__name__
    assert not isinstance(driver, DictionaryDriver)  # in-process: spliced into its hook tree


def test_one_run_with_cache_validates_once(
    bridge_of: Callable[[str], TransformerBridge],
) -> None:
    bridge = bridge_of("llama")
    names = ["blocks.0.hook_resid_post", "hook_embed", "blocks.1.attn.hook_z"]
    spec = {"blocks.0.mlp.hook_post": {"op": "scale", "factor": 0.5}}
    with validation_calls() as counts:
        bridge.run_with_cache(
            ["two prompts", "b"], names_filter=names, intervene=spec, stop_at_layer=2
        )
    lookups = {k.removeprefix("lookup:"): n for k, n in counts.items() if k.startswith("lookup:")}
    assert lookups == dict.fromkeys([*names, *spec], 1), counts
    assert (counts["pad_batch"], counts["block_index"]) == (1, 1), counts
    assert (counts["build_plan"], counts["compile_specs"]) == (1, 1), counts


def test_each_prompts_specs_are_compiled_once(
    bridge_of: Callable[[str], TransformerBridge],
) -> None:
    # Different specs per prompt: one composition per prompt, inside one plan.
    bridge = bridge_of("llama")
    specs = [
        {"blocks.0.mlp.hook_post": {"op": "scale", "factor": 0.5}},
        {"blocks.0.mlp.hook_post": [{"op": "add", "value": 1.0, "pos": [0]}]},
    ]
    with validation_calls() as counts:
        bridge.run_with_cache(["two prompts", "b"], names_filter=["hook_embed"], intervene=specs)
    assert (counts["build_plan"], counts["compile_specs"]) == (1, 2), counts
