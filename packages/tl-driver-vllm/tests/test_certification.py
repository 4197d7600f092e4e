"""Certification on the engine: a layout read from a wrong description is caught there.

The hf driver's description places vLLM's sites on its Transformers backend; tl-core's
equations over one engine forward must catch a description that claims a wrong structure,
naming the equation and the hook, and never serve the wrong tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import ENGINE_OPTIONS  # noqa: E402

from tl_core import ConfigError, RemoteBridge  # noqa: E402
from tl_core.architecture import FamilyDescription  # noqa: E402
from tl_driver_hf import adapters  # noqa: E402
from tl_driver_hf.adapters import ArchitectureAdapter  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def described(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Register a (wrong) hf description for the test, and take it back after."""
    added: list[ArchitectureAdapter] = []

    def register(adapter: ArchitectureAdapter) -> None:
        adapters.register_adapter(adapter)
        added.append(adapter)

    yield register
    for adapter in added:
        adapters._EXTRA.remove(adapter)


def _helium(**wrong: Any) -> ArchitectureAdapter:
    description = FamilyDescription("helium-wrong", ("helium",), ("HeliumForCausalLM",))
    return ArchitectureAdapter(description=description, **wrong)


def test_an_inferred_architecture_is_certified_on_the_engine(default_checkpoint: Any) -> None:
    bridge = RemoteBridge.boot_vllm(default_checkpoint("helium"), dtype="float32", **ENGINE_OPTIONS)
    try:
        cert = bridge.certification
        assert cert is not None and cert.driver == "vllm" and cert.inferred and cert.level == "full"
        assert not cert.failed, [c.line() for c in cert.failed]
        assert any(c.equation.startswith("blocks.1.hook_out ==") for c in cert.checks)
        assert "inferred and certified on a shrunk copy" in cert.description["layout"]
        again = bridge.driver.certify()
        assert [c.equation for c in again.checks] == [c.equation for c in cert.checks]
    finally:
        bridge.close()


def test_swapped_norms_are_caught_and_not_served(default_checkpoint: Any, described: Any) -> None:
    described(_helium(ln1="post_attention_layernorm", ln2="input_layernorm"))
    bridge = RemoteBridge.boot_vllm(default_checkpoint("helium"), dtype="float32", **ENGINE_OPTIONS)
    try:
        cert = bridge.certification
        assert cert is not None and cert.failed
        failed_hooks = {h for c in cert.failed for h in c.hooks}
        assert "blocks.0.ln1.hook_out" in failed_hooks, [c.line() for c in cert.failed]
        for name in failed_hooks:
            assert name not in bridge.driver.supported_hook_points
        assert "blocks.0.ln1.hook_out" in bridge.driver.non_fireable_reasons
        assert "failed: " in bridge.driver.non_fireable_reasons["blocks.0.ln1.hook_out"]
    finally:
        bridge.close()


def test_swapped_sublayers_serve_neither_output(default_checkpoint: Any, described: Any) -> None:
    # Attention and MLP swapped: the block equation still holds (the sum is the same), but
    # the residual between them does not, and the hooks inside are looked for in the wrong
    # module; neither sublayer's output may be served.
    described(_helium(attn="mlp", mlp="self_attn"))
    bridge = RemoteBridge.boot_vllm(default_checkpoint("helium"), dtype="float32", **ENGINE_OPTIONS)
    try:
        cert = bridge.certification
        assert cert is not None and cert.level == "residual"
        served = bridge.driver.supported_hook_points
        for name in (
            "attn.hook_out",
            "mlp.hook_out",
            "ln2.hook_in",
            "attn.hook_z",
            "mlp.hook_post",
        ):
            assert f"blocks.0.{name}" not in served, name
        reasons = bridge.driver.non_fireable_reasons
        assert reasons["blocks.0.ln2.hook_in"].startswith("uncertified: failed: ")
        assert "never fired" in reasons["blocks.0.attn.hook_z"]
        assert reasons["blocks.0.mlp.hook_out"].startswith("uncertified: failed: ")
        assert {"blocks.0.hook_out", "blocks.1.hook_in", "ln_final.hook_out"} <= served
    finally:
        bridge.close()


def test_a_wrong_run_refuses_the_boot(default_checkpoint: Any, described: Any) -> None:
    # A final norm that is not the one the unembedding reads: the logits tl rebuilds from it
    # are not the engine's, so nothing may be served.
    described(_helium(final_norm="model.layers.1.post_attention_layernorm"))
    with pytest.raises(ConfigError, match=r"fails certification"):
        RemoteBridge.boot_vllm(
            default_checkpoint("helium"), dtype="float32", **ENGINE_OPTIONS
        ).close()
