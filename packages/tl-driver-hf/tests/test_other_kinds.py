"""Checkpoints of a kind tl does not serve are refused with what they are, never booted as a part.

The hf driver serves decoder-only causal LMs, masked LMs and vision-language models. A
sequence-to-sequence model, an image classifier or a speech recogniser is refused with a
``ConfigError`` naming its kind. The references are plain transformers: what
``AutoModelForCausalLM`` does with the same folder, and which weights the file holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
    BertConfig,
    BertForMaskedLM,
    T5Config,
    T5ForConditionalGeneration,
    Wav2Vec2ForSequenceClassification,
)

from tl_core import ConfigError, UserError
from tl_core.driver_api import ByteTokenizer
from tl_driver_hf import HFDriver

_BERT_SIZES: dict[str, Any] = {
    "vocab_size": 200, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    "intermediate_size": 64, "max_position_embeddings": 32,
}  # fmt: skip


def _file_keys(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_an_encoder_decoder_without_a_causal_lm_boots_whole(tmp_path: Path) -> None:
    folder = tmp_path / "t5"
    T5ForConditionalGeneration(
        T5Config(vocab_size=200, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    ).save_pretrained(folder)
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        AutoModelForCausalLM.from_pretrained(folder)  # what transformers alone does
    driver = HFDriver.boot(str(folder), tokenizer=ByteTokenizer())
    assert type(driver.hf_model).__name__ == "T5ForConditionalGeneration"
    assert driver.certification is not None and not driver.certification.failed
    # Its config names no decoder start token, so a decoder input must be given.
    with pytest.raises(ConfigError, match="names no decoder start token"):
        driver.decoder_start_ids  # noqa: B018
    with pytest.raises(UserError, match="load_weights=False: not served on encoder-decoders"):
        HFDriver.boot(str(folder), load_weights=False)


def test_an_audio_classifier_is_refused_naming_its_kind(tmp_path: Path) -> None:
    """Image classifiers and CTC models boot (tests/test_signal_models.py); a kind tl does
    not serve is refused by the mapping transformers files it under."""
    folder = tmp_path / "wav2vec2-classifier"
    config = AutoConfig.for_model(
        "wav2vec2", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    config.architectures = ["Wav2Vec2ForSequenceClassification"]
    Wav2Vec2ForSequenceClassification(config).save_pretrained(folder)
    with pytest.raises(
        ConfigError, match=r"is an audio classifier \(Wav2Vec2ForSequenceClassification\)"
    ):
        HFDriver.boot(str(folder))


def test_a_masked_lm_whose_weights_fit_its_causal_class_boots_as_the_masked_lm(
    tmp_path: Path,
) -> None:
    """transformers builds BertLMHeadModel from a BertForMaskedLM checkpoint and every weight
    finds its place: only the config's architectures tell it is an encoder, and tl builds
    the masked LM they name (``tests/test_encoders.py`` checks it against transformers)."""
    folder = tmp_path / "bert"
    BertForMaskedLM(BertConfig(**_BERT_SIZES)).save_pretrained(folder)
    plain, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(plain).__name__ == "BertLMHeadModel"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    driver = HFDriver.boot(str(folder))
    assert type(driver.hf_model).__name__ == "BertForMaskedLM"
    assert driver.architecture.kind == "masked_lm"


def test_a_config_transformers_refuses_for_the_causal_class_is_a_config_error(
    tmp_path: Path,
) -> None:
    config = AutoConfig.for_model(
        "reformer", vocab_size=200, hidden_size=32, num_attention_heads=2, feed_forward_size=64,
        attention_head_size=16, attn_layers=["local", "local"], axial_pos_embds_dim=[16, 16],
        axial_pos_shape=[4, 8], max_position_embeddings=32, is_decoder=False,
    )  # fmt: skip
    AutoModelForMaskedLM.from_config(config).save_pretrained(tmp_path / "reformer")
    # The checkpoint claims the causal class its config cannot build.
    path = tmp_path / "reformer" / "config.json"
    path.write_text(path.read_text().replace("ReformerForMaskedLM", "ReformerModelWithLMHead"))
    with pytest.raises(AssertionError, match="is_decoder=True"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "reformer")
    with pytest.raises(ConfigError) as refused:
        HFDriver.boot(str(tmp_path / "reformer"))
    message = str(refused.value)
    assert "transformers cannot build ReformerModelWithLMHead" in message
    assert "AssertionError: If you want to use `ReformerModelWithLMHead`" in message


def test_a_vision_language_checkpoint_is_not_booted_as_its_language_model(tmp_path: Path) -> None:
    """Qwen3_5ForCausalLM declares the vision tower of a Qwen3_5ForConditionalGeneration
    checkpoint never loaded, so transformers reports nothing; the tower is still dropped. tl
    builds the class the config names, whole (``tests/test_vision_language.py`` runs
    images through a LLaVA)."""
    text = {
        "vocab_size": 200, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    }  # fmt: skip
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": 32}  # fmt: skip
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    folder = tmp_path / "qwen3_5"
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    plain, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    assert any(k.startswith("model.visual.") for k in _file_keys(folder))
    assert not any("visual" in k for k in plain.state_dict())
    driver = HFDriver.boot(str(folder))
    assert type(driver.hf_model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert any(k.startswith("model.visual.") for k in driver.hf_model.state_dict())
    # Its processor decides the pixels' size and grid (image_grid_thw): no images from tl,
    # and the reason says so.
    assert not driver.supports("images")
    assert driver.images_refused is not None
    assert "states no image size" in driver.images_refused
