"""Models that read pixels or audio (ViT, DeiT, wav2vec2, HuBERT) on the hf driver,
against plain transformers (models that read audio feature frames, such as Parakeet, are
checked the same way by the coverage scan, on its own shrunk configs).

The references are transformers alone: forward pre-hooks record what each of its blocks
receives (the block lists are named here by hand, per model type), forward hooks what they
return, its own logits, and plain torch hooks make the same edits tl's specs make.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from torch import nn
from transformers import AutoConfig, AutoModelForImageClassification

from tl_core import (
    ConfigError,
    HookNameError,
    TransformerBridge,
    UnsupportedFeatureError,
    UserError,
)
from tl_driver_hf._signal._certify import certify_signal
from tl_driver_hf._signal._driver import SignalDriver
from tl_driver_hf.testing import write_signal_checkpoint

_hooks_spec = importlib.util.spec_from_file_location(
    "_hf_plain_hooks", Path(__file__).with_name("_plain_hooks.py")
)
assert _hooks_spec is not None and _hooks_spec.loader is not None
_plain_hooks = importlib.util.module_from_spec(_hooks_spec)
_hooks_spec.loader.exec_module(_plain_hooks)
layer_inputs = _plain_hooks.layer_inputs

#: model type -> (the block list, by hand; the input of two examples).
TYPES: dict[str, tuple[str, tuple[int, ...]]] = {
    "vit": ("vit.layers", (2, 3, 32, 32)),
    "deit": ("deit.layers", (2, 3, 32, 32)),
    "wav2vec2": ("wav2vec2.encoder.layers", (2, 1600)),
    "hubert": ("hubert.encoder.layers", (2, 1600)),
}
KEYS = {4: "pixel_values", 2: "input_values", 3: "input_features"}


def _signal(name: str, seed: int = 0) -> torch.Tensor:
    return torch.randn(TYPES[name][1], generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def bridges(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TransformerBridge]:
    root = tmp_path_factory.mktemp("signal")
    return {
        name: TransformerBridge.boot_transformers(str(write_signal_checkpoint(name, root / name)))
        for name in TYPES
    }


def _blocks(bridge: TransformerBridge, name: str) -> list[nn.Module]:
    return list(bridge.driver.hf_model.get_submodule(TYPES[name][0]))


def _plain(bridge: TransformerBridge, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return bridge.driver.hf_model(**{KEYS[x.ndim]: x}).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(TYPES))
def test_blocks_inputs_outputs_and_logits_equal_plain_transformers(
    name: str, bridges: dict[str, TransformerBridge]
) -> None:
    bridge = bridges[name]
    assert bridge.driver.certification.level == "residual"
    blocks = _blocks(bridge, name)
    assert bridge.cfg.n_layers == len(blocks) == 2
    x = _signal(name)
    seen: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    handles = [
        b.register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o))
        for b in blocks
    ]
    try:
        with layer_inputs(blocks, seen):
            want = _plain(bridge, x)
    finally:
        for handle in handles:
            handle.remove()
    logits, cache = bridge.run_with_cache(x)
    torch.testing.assert_close(logits, want)
    for i in range(len(blocks)):
        torch.testing.assert_close(cache[f"blocks.{i}.hook_in"], seen[i])
        torch.testing.assert_close(cache[f"blocks.{i}.hook_out"], outputs[i])
    # TransformerLens's residual names are the same tensors.
    assert torch.equal(cache["blocks.1.hook_resid_pre"], cache["blocks.1.hook_in"])
    assert cache.lengths == (seen[0].shape[1],) * x.shape[0]


@pytest.mark.parametrize("name", sorted(TYPES))
def test_an_add_at_block_1_equals_a_plain_pre_hook_and_positions_are_the_stream_s(
    name: str, bridges: dict[str, TransformerBridge]
) -> None:
    bridge = bridges[name]
    x = _signal(name, seed=1)
    vector = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(3))
    got = bridge(x, intervene={"blocks.1.hook_in": {"op": "add", "value": vector.tolist()}})

    def add(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (args[0] + vector, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + vector}

    handle = _blocks(bridge, name)[1].register_forward_pre_hook(add, with_kwargs=True)
    try:
        want = _plain(bridge, x)
    finally:
        handle.remove()
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, _plain(bridge, x))
    # An edit at one position of the stream (ViT's class token, the first audio frame).
    _, cache = bridge.run_with_cache(
        x,
        names_filter=["blocks.1.hook_in"],
        intervene={"blocks.0.hook_out": {"op": "suppress", "pos": 0}},
    )
    _, clean = bridge.run_with_cache(x, names_filter=["blocks.1.hook_in"])
    assert torch.equal(
        cache["blocks.1.hook_in"][:, 0], torch.zeros_like(cache["blocks.1.hook_in"][:, 0])
    )
    assert torch.equal(cache["blocks.1.hook_in"][:, 1:], clean["blocks.1.hook_in"][:, 1:])


def test_every_weight_loads_and_only_the_stream_is_served_with_why(
    bridges: dict[str, TransformerBridge],
) -> None:
    bridge = bridges["vit"]
    assert sorted(bridge.hook_dict) == sorted(
        f"blocks.{i}.{s}" for i in range(2) for s in ("hook_in", "hook_out")
    )
    status = bridge.driver.certification.statuses["blocks.0.attn.hook_pattern"]
    assert status.status == "uncertified" and "not their sublayers yet" in status.reason
    assert bridge.cfg.normalization_type == "unknown"
    assert bridge.cfg.d_vocab == bridge.driver.hf_model.config.num_labels
    assert bridge.tokenizer.decode([1]) == bridge.driver.hf_model.config.id2label[1]
    with pytest.raises(HookNameError, match=r"attn\.hook_pattern'.*not their sublayers yet"):
        bridge.run_with_cache(_signal("vit"), names_filter=["blocks.0.attn.hook_pattern"])


def test_bad_inputs_and_what_such_a_model_cannot_do_are_refused_with_the_fix(
    bridges: dict[str, TransformerBridge],
) -> None:
    vit, speech = bridges["vit"], bridges["wav2vec2"]
    with pytest.raises(UserError, match=r"reads pixels, not tokens.*\[batch, 3, 32, 32\]; got str"):
        vit("a photo of a cat")
    with pytest.raises(
        UserError, match=r"reads pixels \[batch, 3, 32, 32\]; got shape \(2, 3, 16, 16\)"
    ):
        vit(torch.randn(2, 3, 16, 16))
    with pytest.raises(UserError, match="float tensor"):
        vit(torch.zeros(2, 3, 32, 32, dtype=torch.long))
    with pytest.raises(UserError, match=r"audio samples \[batch, samples\]"):
        speech(torch.randn(2, 1, 1600))
    with pytest.raises(UnsupportedFeatureError, match="next-token loss"):
        vit(_signal("vit"), return_type="loss")
    with pytest.raises(UnsupportedFeatureError, match="not tokens"):
        vit.generate("a cat", max_new_tokens=2)
    with pytest.raises(UserError, match="images= feeds a vision-language model"):
        vit(_signal("vit"), images=_signal("vit"))
    with pytest.raises(UnsupportedFeatureError, match="partial forwards"):
        vit(_signal("vit"), stop_at_layer=1)
    with pytest.raises(UserError, match="pos"):
        vit(_signal("vit"), intervene={"blocks.0.hook_out": {"op": "suppress", "pos": 40}})
    # One image, or one waveform, may come without its batch axis.
    assert vit(_signal("vit")[0]).shape == (1, vit.cfg.d_vocab)


def test_a_hierarchical_model_is_refused_naming_its_stages(tmp_path: Path) -> None:
    config = AutoConfig.for_model(
        "swin", embed_dim=16, depths=[2, 2], num_heads=[2, 4], image_size=32, patch_size=4
    )
    config.architectures = ["SwinForImageClassification"]
    AutoModelForImageClassification.from_config(config).save_pretrained(tmp_path / "swin")
    with pytest.raises(ConfigError, match=r"hierarchical.*depths"):
        TransformerBridge.boot_transformers(str(tmp_path / "swin"))


def test_certification_refuses_a_stream_read_from_the_wrong_blocks(
    bridges: dict[str, TransformerBridge],
) -> None:
    """Fault injection: tl's sites wired to the blocks in reverse order must fail."""
    good = bridges["vit"].driver
    assert isinstance(good, SignalDriver)
    broken = SignalDriver(good.hf_model, "pixels", name="broken")
    n = broken.info.n_layers
    broken._sites = {  # blocks.{i}.* read from block n-1-i
        name: replace(site, module=broken.layout.blocks[n - 1 - int(name.split(".")[1])])
        for name, site in broken._sites.items()
    }
    with pytest.raises(ConfigError, match="does not reproduce the model"):
        certify_signal(broken, name="broken")


def test_tl_capture_refuses_a_model_that_reads_no_text(
    bridges: dict[str, TransformerBridge], tmp_path: Path
) -> None:
    from tl_core.capture import CaptureConfig, capture

    text = tmp_path / "docs.txt"
    text.write_text("a photo of a cat\n")
    folder = bridges["vit"].driver.hf_model.name_or_path
    config = CaptureConfig(
        model=str(folder), driver="hf", hooks=("blocks.0.hook_out",), input=str(text),
        context_size=8,
    )  # fmt: skip
    with pytest.raises(UserError, match=r"reads pixels, not text.*nothing was written"):
        capture(config, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()


@settings(max_examples=30, deadline=None)
@example(shape=[0, 3, 32, 32], floating=True)
@example(shape=[3, 32, 32], floating=True)
@given(
    shape=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=5),
    floating=st.booleans(),
)
def test_any_input_is_taken_or_refused_before_the_model_runs(
    bridges: dict[str, TransformerBridge], shape: list[int], floating: bool
) -> None:
    """Every tensor handed to a ViT is either a batch of 32x32 RGB images (served, one
    position per patch and the class token) or refused with a UserError naming the shape
    it reads; nothing else escapes."""
    bridge = bridges["vit"]
    x = torch.zeros(shape, dtype=torch.float32 if floating else torch.long)
    fits = floating and (
        tuple(shape) == (3, 32, 32) or (len(shape) == 4 and tuple(shape[1:]) == (3, 32, 32))
    )
    if fits and x.numel():
        logits = bridge(x)
        assert logits.shape == (1 if len(shape) == 3 else shape[0], bridge.cfg.d_vocab)
    else:
        with pytest.raises(UserError, match=r"\[batch, 3, 32, 32\]|empty batch"):
            bridge(x)
