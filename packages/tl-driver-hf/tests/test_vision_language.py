"""Vision-language models on the hf driver, against plain transformers.

A ``LlavaForConditionalGeneration`` checkpoint boots as that class, whole (vision tower,
projector, language model), with its language stack's hooks certified and its images
described. The references are transformers alone: ``AutoModelForImageTextToText`` given the
same ids and pixels (its logits, the language layers' inputs seen by plain pre-hooks, its
greedy ``generate``), ``get_image_features`` for what the image tokens receive, and the same
``add`` made by a plain pre-hook on a language layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoModelForImageTextToText,
    CLIPImageProcessor,
    Idefics2Config,
    Idefics2ForConditionalGeneration,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from tl_core import SpecError, TransformerBridge, UnsupportedFeatureError, UserError
from tl_driver_hf import HFDriver
from tl_driver_hf.testing import write_tiny_checkpoint
from tl_driver_hf.testing._tokenizer import train_tiny_tokenizer

_IMAGE = 500  # the image token's id
_TEXT: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}  # fmt: skip
_VISION: dict[str, Any] = {
    "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
}  # fmt: skip
_PER_IMAGE = 17  # (32 / 8) ** 2 patches and the class token ("full" selection)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlavaConfig(
        text_config=_TEXT,
        vision_config=_VISION,
        image_token_index=_IMAGE,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    for p in model.parameters():  # untrained norms and biases hide mistakes: move them
        p.data.add_(0.05 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("llava") / "llava"
    model.save_pretrained(folder)
    train_tiny_tokenizer(512).save_pretrained(folder)
    _processor().save_pretrained(folder)
    return folder


def _processor() -> CLIPImageProcessor:
    """The image processor LLaVA checkpoints ship, for the tower's 32 x 32 pixels."""
    return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


@pytest.fixture(scope="module")
def bridge(llava: Path) -> TransformerBridge:
    return TransformerBridge(HFDriver.boot(str(llava)))


@pytest.fixture(scope="module")
def plain(llava: Path) -> nn.Module:
    model = AutoModelForImageTextToText.from_pretrained(llava, attn_implementation="eager")
    return model.eval()


def _pixels(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, 3, 32, 32), generator=torch.Generator().manual_seed(seed))


def _widened(ids: list[int]) -> list[int]:
    return [t for i in ids for t in ([i] * _PER_IMAGE if i == _IMAGE else [i])]


def _layer_inputs(model: nn.Module, ids: list[int], pixels: torch.Tensor) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    layers = model.model.language_model.layers
    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), pixel_values=pixels)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_a_vision_language_checkpoint_boots_whole_and_describes_its_images(
    llava: Path, bridge: TransformerBridge
) -> None:
    driver = bridge.driver
    assert type(driver.hf_model).__name__ == "LlavaForConditionalGeneration"
    with safe_open(str(llava / "model.safetensors"), framework="pt") as f:
        in_file = set(f.keys())
        sizes = {k: torch.Size(f.get_slice(k).get_shape()).numel() for k in in_file}
    held = driver.hf_model.state_dict()
    # transformers writes LLaVA's weights under their legacy names (vision_tower.*), and
    # reads them back under its own (model.vision_tower.*): every one is held.
    assert any(k.startswith("vision_tower.") for k in in_file)
    assert any(k.startswith("model.vision_tower.") for k in held)
    assert any(k.startswith("model.multi_modal_projector.") for k in held)
    assert len(held) == len(in_file)
    assert sum(t.numel() for t in held.values()) == sum(sizes.values())
    vision = bridge.architecture.vision
    assert vision is not None
    assert (vision.tower, vision.image_size, vision.channels) == ("clip_vision_model", (32, 32), 3)
    assert (vision.image_token_id, vision.tokens_per_image) == (_IMAGE, _PER_IMAGE)
    cert = driver.certification
    assert cert is not None and cert.level == "full"
    image_lines = [c for c in cert.checks if c.equation.startswith("with an image")]
    assert len(image_lines) == 2 and all(c.passed for c in image_lines)
    assert driver.supports("images")
    facts = bridge.architecture.facts()
    assert facts["images"] == (
        "clip_vision_model tower on 3 x 32 x 32 pixels; each image fills 17 positions of token 500"
    )


def test_a_prompt_with_images_gets_what_transformers_gives_it(
    bridge: TransformerBridge, plain: nn.Module
) -> None:
    ids = [1, 40, _IMAGE, 77, 9, _IMAGE, 3]  # one token per image: tl widens each
    pixels = _pixels(2)
    logits, cache = bridge.run_with_cache(torch.tensor([ids]), images=pixels)
    full = _widened(ids)
    assert logits.shape[1] == len(full) == cache["blocks.0.hook_in"].shape[1]
    with torch.no_grad():
        reference = plain(input_ids=torch.tensor([full]), pixel_values=pixels).logits
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    for i, seen in enumerate(_layer_inputs(plain, full, pixels)):
        torch.testing.assert_close(cache[f"blocks.{i}.hook_in"], seen, rtol=1e-4, atol=1e-5)
    # The image positions receive the projected features, image by image, in order.
    with torch.no_grad():
        features = torch.cat(list(plain.get_image_features(pixel_values=pixels).pooler_output))
    at_image = torch.tensor(full) == _IMAGE
    torch.testing.assert_close(
        cache["blocks.0.hook_in"][0, at_image], features.reshape(-1, 64), rtol=1e-4, atol=1e-5
    )
    # The rotary module reads the merged embeddings (TransformerLens 4.3's rotary_emb.hook_in):
    # on a model that reads images that is the stream entering block 0, not embed.hook_out.
    assert bridge.namespace.lookup("rotary_emb.hook_in") == "blocks.0.hook_in"
    assert not torch.allclose(
        cache["embed.hook_out"][0, at_image], cache["blocks.0.hook_in"][0, at_image]
    )
    # Ids already holding a whole run per image are taken as they are.
    again, _ = bridge.run_with_cache(torch.tensor([full]), images=pixels)
    torch.testing.assert_close(again, logits)


def test_images_as_pil_arrays_or_files_go_through_the_checkpoints_processor(
    bridge: TransformerBridge, plain: nn.Module, tmp_path: Path
) -> None:
    generator = torch.Generator().manual_seed(6)
    array = torch.randint(0, 256, (40, 48, 3), generator=generator, dtype=torch.uint8).numpy()
    picture = Image.fromarray(array)
    path = tmp_path / "picture.png"
    picture.save(path)
    pixels = _processor()(images=[picture], return_tensors="pt")["pixel_values"]
    ids = torch.tensor([[1, 40, _IMAGE, 77]])
    want = bridge(ids, images=pixels)
    for given in (picture, [array], [str(path)], path):
        torch.testing.assert_close(bridge(ids, images=given), want)
    with torch.no_grad():
        theirs = plain(input_ids=torch.tensor([_widened(ids[0].tolist())]), pixel_values=pixels)
    torch.testing.assert_close(want, theirs.logits, rtol=1e-4, atol=1e-5)
    with pytest.raises(UserError, match="does not exist"):
        bridge(ids, images=[str(tmp_path / "missing.png")])
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(UserError, match="no image PIL can read"):
        bridge(ids, images=[tmp_path / "notes.txt"])


def test_images_that_are_not_pixels_need_the_checkpoints_processor(
    llava: Path, tmp_path: Path
) -> None:
    import shutil

    bare = tmp_path / "llava-without-processor"
    shutil.copytree(llava, bare)
    (bare / "preprocessor_config.json").unlink()
    bridge = TransformerBridge(HFDriver.boot(str(bare)))
    picture = Image.new("RGB", (32, 32))
    with pytest.raises(UserError, match="holds no image processor"):
        bridge(torch.tensor([[1, _IMAGE]]), images=[picture])
    # Pixel tensors need no processor.
    assert bridge(torch.tensor([[1, _IMAGE]]), images=_pixels(1)).shape[1] == 1 + _PER_IMAGE


def test_a_ragged_batch_with_images_gets_each_prompt_alone(bridge: TransformerBridge) -> None:
    prompts = [[1, _IMAGE, 40, 41, 42, 43], [1, 8, _IMAGE]]
    pixels = _pixels(2, seed=1)
    both = bridge(prompts, images=pixels)
    for b, prompt in enumerate(prompts):
        alone = bridge(torch.tensor([prompt]), images=pixels[b : b + 1])
        n = len(_widened(prompt))
        torch.testing.assert_close(both[b, :n], alone[0], rtol=1e-4, atol=1e-5)


def test_generation_with_an_image_equals_transformers_greedy_generate(
    bridge: TransformerBridge, plain: nn.Module
) -> None:
    ids = [1, 40, _IMAGE, 77]
    pixels = _pixels(1, seed=2)
    ours = bridge.generate(torch.tensor([ids]), max_new_tokens=5, images=pixels, stop_at_eos=False)
    full = torch.tensor([_widened(ids)])
    with torch.no_grad():
        theirs = plain.generate(
            input_ids=full, pixel_values=pixels, max_new_tokens=5, do_sample=False,
            min_new_tokens=5, pad_token_id=0,
        )  # fmt: skip
    assert ours.tolist() == theirs[:, full.shape[1] :].tolist()


@pytest.mark.parametrize(
    ("edit", "rows"),
    [
        ({"op": "add", "pos": [3, 5]}, [3, 5]),
        ({"op": "suppress", "pos": "image"}, list(range(1, 1 + _PER_IMAGE))),
    ],
    ids=["add-at-positions", "ablate-the-image"],
)
def test_an_edit_with_an_image_equals_a_plain_pre_hook(
    bridge: TransformerBridge, plain: nn.Module, edit: dict[str, Any], rows: list[int]
) -> None:
    """An add at listed positions, and the image ablated at one layer (``"pos": "image"``),
    against the same edit by a plain pre-hook on the language layer."""
    ids = _widened([1, _IMAGE, 40, 41])
    pixels = _pixels(1, seed=3)
    delta = torch.randn(64, generator=torch.Generator().manual_seed(4))
    spec = {**edit, "value": delta.tolist()} if edit["op"] == "add" else edit
    ours = bridge(torch.tensor([ids]), images=pixels, intervene={"blocks.1.hook_in": spec})

    def change(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = (args[0] if args else kwargs["hidden_states"]).clone()
        if edit["op"] == "add":
            hidden[:, rows] += delta
        else:
            hidden[:, rows] = 0.0
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    layer = plain.model.language_model.layers[1]
    handle = layer.register_forward_pre_hook(change, with_kwargs=True)
    try:
        with torch.no_grad():
            theirs = plain(input_ids=torch.tensor([ids]), pixel_values=pixels).logits
    finally:
        handle.remove()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_a_spec_on_the_image_positions_edits_each_prompts_own(bridge: TransformerBridge) -> None:
    """``"pos": "image"`` is each prompt's image positions, wherever its image sits."""
    prompts = [[1, _IMAGE, 40, 41], [1, 8, 9, _IMAGE, 5, 6]]
    pixels = _pixels(2, seed=5)
    named = bridge(
        prompts, images=pixels, intervene={"blocks.1.hook_in": {"op": "suppress", "pos": "image"}}
    )
    listed = bridge(
        prompts,
        images=pixels,
        intervene=[
            {"blocks.1.hook_in": {"op": "suppress", "pos": list(range(1, 1 + _PER_IMAGE))}},
            {"blocks.1.hook_in": {"op": "suppress", "pos": list(range(3, 3 + _PER_IMAGE))}},
        ],
    )
    torch.testing.assert_close(named, listed)
    assert not torch.allclose(named, bridge(prompts, images=pixels))
    # A prompt without an image is left as it is; a run without images refuses the spec.
    mixed = bridge(
        [prompts[0], [1, 2, 3]],
        images=pixels[:1],
        intervene={"blocks.1.hook_in": {"op": "suppress", "pos": "image"}},
    )
    torch.testing.assert_close(mixed[1, :3], bridge([[1, 2, 3]])[0])
    with pytest.raises(SpecError, match="this run has no images"):
        bridge([[1, 2, 3]], intervene={"blocks.1.hook_in": {"op": "suppress", "pos": "image"}})


@pytest.mark.parametrize(
    ("ids", "pixels", "message"),
    [
        ([1, _IMAGE, 5], _pixels(2), r"tokens of 1 image \(prompt 0: 1\) and images= gives 2"),
        ([1, 5], _pixels(1), r"tokens of 0 images .* gives 1 image"),
        ([1, _IMAGE, 5], torch.randn(1, 3, 16, 16), r"takes \(3, 32, 32\)"),
        ([1, _IMAGE, 5], torch.zeros(1, 3, 32, 32, dtype=torch.long), "float pixel values"),
        ([1, _IMAGE, 5], torch.full((1, 3, 32, 32), float("nan")), "NaN"),
        ([1, *[_IMAGE] * 5, 5], _pixels(1), "a run of 5 image tokens"),
        ([1, _IMAGE, 5], [torch.randn(32, 32)], r"image 0 of images= is \(32, 32\)"),
    ],
)
def test_bad_images_are_refused_before_the_model_runs(
    bridge: TransformerBridge, ids: list[int], pixels: Any, message: str
) -> None:
    with pytest.raises(UserError, match=message):
        bridge(torch.tensor([ids]), images=pixels)


def test_images_cannot_start_a_forward_from_a_block(bridge: TransformerBridge) -> None:
    residual = torch.zeros(1, 3 + _PER_IMAGE - 1, 64)
    with pytest.raises(UserError, match="start_at_layer skips"):
        bridge.driver.forward(
            torch.tensor([[1, _IMAGE, 5]]), images=_pixels(1), start_at_layer=1, residual=residual
        )


def test_a_model_without_a_vision_tower_refuses_images(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint("llama", tmp_path / "llama")
    bridge = TransformerBridge(HFDriver.boot(str(folder)))
    assert bridge.architecture is not None and bridge.architecture.vision is None
    assert bridge.namespace.lookup("rotary_emb.hook_in") == "embed.hook_out"
    with pytest.raises(UnsupportedFeatureError, match="takes no images"):
        bridge(torch.tensor([[1, 2, 3]]), images=_pixels(1))


@pytest.fixture
def broken_projection(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fault injection: what the image positions should receive is misread by a factor 2."""
    from tl_driver_hf._certification import _image_checks

    real = _image_checks.image_features
    monkeypatch.setattr(_image_checks, "image_features", lambda m, p, **kw: 2 * real(m, p, **kw))
    yield


def test_a_failed_image_check_stops_images_and_keeps_the_text(
    llava: Path, broken_projection: None
) -> None:
    driver = HFDriver.boot(str(llava))
    cert = driver.certification
    assert cert is not None
    failed = [c for c in cert.checks if not c.passed]
    assert [c.equation for c in failed] == [
        "with an image: blocks.0.hook_in at the image positions == the projected image features"
    ]
    assert cert.level == "full"  # the text path stays certified
    assert not driver.supports("images")
    assert driver.images_refused is not None and "FAIL" in driver.images_refused
    with pytest.raises(UnsupportedFeatureError, match="takes no images"):
        TransformerBridge(driver)(torch.tensor([[1, _IMAGE]]), images=_pixels(1))


@pytest.fixture(scope="module")
def idefics2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Idefics2: a SigLIP-style tower on 32 x 32 pixels and a perceiver resampler
    that gives each image 4 positions, over a Mistral of width 64. It takes its images as
    one list per prompt, ``[batch, n, c, h, w]``."""
    config = Idefics2Config(
        text_config={**_TEXT, "model_type": "mistral"},
        vision_config={key: v for key, v in _VISION.items() if key != "model_type"},
        perceiver_config={
            "resampler_n_latents": 4, "resampler_depth": 1, "resampler_n_heads": 2,
            "resampler_head_dim": 16, "num_key_value_heads": 1, "hidden_size": 64,
        },
        image_token_id=_IMAGE,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Idefics2ForConditionalGeneration(config)
    for p in model.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("idefics2") / "idefics2"
    model.save_pretrained(folder)
    train_tiny_tokenizer(512).save_pretrained(folder)
    return folder


def test_a_model_that_takes_a_list_of_images_per_prompt_gets_them_in_order(
    idefics2: Path,
) -> None:
    """tl's ``[n, c, h, w]`` images reach Idefics2 as its ``[1, n, c, h, w]`` list: logits
    and an ablation of the image positions equal plain transformers'."""
    bridge = TransformerBridge(HFDriver.boot(str(idefics2)))
    assert bridge.driver.grouped_pixels and bridge.driver.supports("images")
    assert bridge.architecture.vision.tokens_per_image == 4
    plain = AutoModelForImageTextToText.from_pretrained(idefics2, attn_implementation="eager")
    ids = [1, 40, _IMAGE, 77, 9, _IMAGE, 3]
    full = [t for i in ids for t in ([i] * 4 if i == _IMAGE else [i])]
    pixels = _pixels(2, seed=6)
    spec = {"blocks.1.hook_in": {"op": "suppress", "pos": "image"}}
    logits = bridge(torch.tensor([ids]), images=pixels)
    ablated = bridge(torch.tensor([ids]), images=pixels, intervene=spec)
    at_image = [i for i, t in enumerate(full) if t == _IMAGE]

    def zero(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = (args[0] if args else kwargs["hidden_states"]).clone()
        hidden[:, at_image] = 0.0
        return (
            ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
        )

    with torch.no_grad():
        want = plain(input_ids=torch.tensor([full]), pixel_values=pixels[None]).logits
        handle = plain.model.text_model.layers[1].register_forward_pre_hook(zero, with_kwargs=True)
        try:
            want_ablated = plain(input_ids=torch.tensor([full]), pixel_values=pixels[None]).logits
        finally:
            handle.remove()
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ablated, want_ablated, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(ablated, logits)
