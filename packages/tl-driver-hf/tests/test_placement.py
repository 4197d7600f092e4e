"""Device placement: one device without accelerate, device maps and disk offload with it."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tl_core import TransformerBridge, UserError

HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
needs_accelerate = pytest.mark.skipif(not HAS_ACCELERATE, reason="needs the accelerate extra")


def test_device_works_without_accelerate(
    checkpoint: Callable[[str], Path], reference_of: Callable[[str], PreTrainedModel]
) -> None:
    bridge = TransformerBridge.boot_transformers(str(checkpoint("llama")), device="cpu")
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.no_grad():
        torch.testing.assert_close(
            bridge(ids), reference_of("llama")(ids).logits, atol=1e-5, rtol=1e-5
        )
    assert bridge.driver.device == torch.device("cpu")


@pytest.mark.skipif(HAS_ACCELERATE, reason="checks the message shown when accelerate is missing")
def test_device_map_without_accelerate_says_what_to_install() -> None:
    with pytest.raises(UserError, match=r"tl-driver-hf\[accelerate\]"):
        TransformerBridge.boot_transformers("no-such-org/model", device_map="auto")


@needs_accelerate
@pytest.mark.parametrize("device_map", ["auto", "disk"])
def test_device_maps_and_disk_offload_keep_every_hook(
    device_map: str,
    checkpoint: Callable[[str], Path],
    reference_of: Callable[[str], PreTrainedModel],
    tmp_path: Path,
) -> None:
    options: dict[str, object] = {"device_map": device_map}
    if device_map == "disk":
        options = {
            "device_map": {
                "model.embed_tokens": "cpu",
                "model.layers.0": "cpu",
                "model.layers.1": "disk",
                "model.norm": "cpu",
                "model.rotary_emb": "cpu",
                "lm_head": "cpu",
            },
            "offload_folder": str(tmp_path),
        }
    bridge = TransformerBridge.boot_transformers(str(checkpoint("llama")), **options)
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
        expected = reference_of("llama")(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert set(cache.keys()) == set(bridge.hook_dict)
    for module in bridge.driver.hf_model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    if device_map == "disk":
        assert bridge.W_Q.is_meta  # offloaded weights have shapes, not values
        with pytest.raises(UserError, match="offloaded norm"), torch.no_grad():
            bridge(ids, intervene={"blocks.1.ln1.hook_normalized": {"op": "scale", "factor": 2.0}})
