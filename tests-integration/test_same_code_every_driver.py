"""The same analysis code on the native and hf drivers: names, cache helpers and specs agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tl_core import ActivationCache, TransformerBridge

pytestmark = pytest.mark.integration
write_tiny_checkpoint = pytest.importorskip("tl_driver_hf.testing").write_tiny_checkpoint


def _analyse(bridge: TransformerBridge, prompt: str) -> tuple[torch.Tensor, ActivationCache]:
    """Analysis code a researcher writes once: capture, decompose, attribute."""
    logits, cache = bridge.run_with_cache(prompt)
    token = int(logits[0, -1].argmax())
    parts = cache.decompose_resid(pos_slice=-1)
    attrs = cache.logit_attrs(parts, tokens=token, pos_slice=-1)
    return attrs, cache


@pytest.fixture(scope="module")
def bridges(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TransformerBridge]:
    folder = write_tiny_checkpoint("llama", Path(tmp_path_factory.mktemp("ckpt")) / "llama")
    return {
        "native": TransformerBridge.boot_native(
            "llama", n_layers=2, d_model=128, n_heads=4, d_head=32
        ),
        "hf": TransformerBridge.boot_transformers(str(folder)),
    }


@pytest.mark.parametrize("driver", ["native", "hf"])
def test_decomposition_sums_to_the_residual_and_attributions_to_the_logit(
    bridges: dict[str, TransformerBridge], driver: str
) -> None:
    bridge = bridges[driver]
    with torch.no_grad():
        attrs, cache = _analyse(bridge, "Same code, every driver")
    parts = cache.decompose_resid(pos_slice=-1)
    final = cache[f"blocks.{bridge.cfg.n_layers - 1}.hook_resid_post"][:, -1]
    torch.testing.assert_close(parts.sum(0), final, atol=1e-4, rtol=1e-4)
    readout = bridge.driver.readout()
    assert readout is not None
    logits = cache["unembed.hook_out"][0, -1]
    token = int(logits.argmax())
    offset = 0.0
    if readout.ln_final_bias is not None:
        offset += float(readout.ln_final_bias @ readout.W_U[:, token])
    if readout.b_U is not None:
        offset += float(readout.b_U[token])
    torch.testing.assert_close(attrs.sum() + offset, logits[token], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("driver", ["native", "hf"])
def test_specs_mean_the_same_on_every_driver(
    bridges: dict[str, TransformerBridge], driver: str
) -> None:
    bridge = bridges[driver]
    spec = {
        "blocks.0.hook_resid_post": [
            {"op": "scale", "factor": 0.0, "pos": 1},
            {"op": "add", "value": 0.5, "pos": 1},
        ]
    }
    with torch.no_grad():
        _, cache = bridge.run_with_cache(
            "Specs agree", names_filter="blocks.0.hook_out", intervene=spec
        )
    edited = cache["blocks.0.hook_out"][0, 1]
    torch.testing.assert_close(edited, torch.full_like(edited, 0.5))
