"""A config and its weights must describe one model: the hf driver boots it whole or refuses.

transformers fills a weight the checkpoint lacks (or holds in another shape) at random and
logs a table; certification would then pass, since it compares the model with itself. The
references here never ask tl: which weights a config's model needs and in which shapes
comes from building that model on the meta device, what the checkpoint holds from its
safetensors header, and what a loaded model holds from plain ``from_pretrained``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    BartForConditionalGeneration,
    LlamaForCausalLM,
)

from tl_core import ConfigError, TransformerBridge
from tl_core.driver_api import ByteTokenizer
from tl_driver_hf import HFDriver
from tl_driver_hf._architecture._describe import shrunk_model
from tl_driver_hf.testing import TINY_FAMILIES, write_tiny_default_checkpoint

WEIGHTS = "model.safetensors"


def _copy_with_config(source: Path, target: Path, **fields: Any) -> Path:
    """``source``'s checkpoint with ``fields`` written into its config.json."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


def _file_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def _needed_shapes(folder: Path, overrides: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight the config's model needs, with its shape (built on the meta device;
    tied weights count once, under the name the checkpoint stores)."""
    config = AutoConfig.from_pretrained(folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in tied}


# -- item 8: a config with more layers than the weights ------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"dtype": "bfloat16"}, {"device_map": "cpu"}, {"certify": False}],
    ids=["default", "bfloat16", "device_map", "uncertified"],
)
def test_a_config_with_more_layers_than_the_weights_is_refused_naming_them(
    options: dict[str, Any], checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy_with_config(checkpoint("llama"), tmp_path / "three", num_hidden_layers=3)
    absent = sorted(set(_needed_shapes(folder, {})) - set(_file_shapes(folder)))
    assert absent and all(k.startswith("model.layers.2.") for k in absent)
    with pytest.raises(ConfigError) as refused:
        HFDriver.boot(str(folder), **options)
    message = str(refused.value)
    assert f"lacks {len(absent)} weights" in message
    assert f"model.layers.2: all {len(absent)} of its weights" in message
    for key in absent[:6]:
        assert key.removeprefix("model.layers.2.") in message
    assert "set num_hidden_layers to 2" in message and repr(str(folder)) in message


def test_an_override_adding_layers_is_refused_too(checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(
        ConfigError, match=r"transformer\.h\.2-3: all 12 of its weights.*set n_layer to 2"
    ):
        HFDriver.boot(str(checkpoint("gpt2")), hf_config_overrides={"num_hidden_layers": 4})


def test_a_missing_learned_buffer_is_a_missing_weight(tmp_path: Path) -> None:
    """DeepSeek-V3's routing bias is a persistent buffer that training sets; transformers
    would give it zeros. A non-persistent one (rotary ``inv_freq``) is never in a file."""
    # One dense layer, then a routed one (whose gate holds the bias).
    config = AutoConfig.for_model(
        "deepseek_v3", first_k_dense_replace=1, n_routed_experts=4, n_group=1, topk_group=1
    )
    folder = tmp_path / "v3"
    shrunk_model(config).save_pretrained(folder)
    weights = load_file(str(folder / WEIGHTS))
    dropped = [k for k in weights if k.endswith("e_score_correction_bias")]
    assert dropped and not any("inv_freq" in k for k in weights)
    save_file({k: v for k, v in weights.items() if k not in dropped}, str(folder / WEIGHTS))
    with pytest.raises(ConfigError, match=r"mlp\.gate\.e_score_correction_bias"):
        HFDriver.boot(str(folder))


def _tiny_bart(folder: Path) -> Path:
    config = BartConfig(
        vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    BartForConditionalGeneration(config).save_pretrained(folder)
    return folder


def test_a_sequence_to_sequence_checkpoint_read_as_a_causal_lm_is_refused_naming_its_encoder(
    tmp_path: Path,
) -> None:
    """Read as BartForCausalLM, a BartForConditionalGeneration checkpoint loses its encoder
    (and ``model.shared``, its embedding), and its decoder embedding and unembedding would
    be random."""
    folder = _tiny_bart(tmp_path / "bart")
    needed, in_file = set(_needed_shapes(folder, {})), set(_file_shapes(folder))
    assert needed - in_file == {"model.decoder.embed_tokens.weight"}
    placeless = in_file - needed
    encoder = {k for k in placeless if k.startswith("model.encoder.")}
    assert encoder and placeless - encoder == {"model.shared.weight", "final_logits_bias"}
    with pytest.raises(ConfigError) as refused:
        HFDriver.boot(str(folder), model_class="BartForCausalLM")
    message = str(refused.value)
    assert (
        "architectures name BartForConditionalGeneration, a sequence-to-sequence model" in message
    )
    assert (
        f"BartForCausalLM transformers builds for it has no place for {len(placeless)}" in message
    )
    assert "its encoder among them" in message
    assert f"model.encoder ({len(encoder)} weights)" in message
    assert "model.shared.weight" in message and "final_logits_bias" in message
    assert "model.decoder.embed_tokens.weight" in message and "lm_head.weight" in message
    assert "serves sequence-to-sequence models whole: boot it without model_class=" in message
    # Booted plainly, it is the whole encoder-decoder, every weight in place.
    whole = HFDriver.boot(str(folder), tokenizer=ByteTokenizer())
    assert type(whole.hf_model).__name__ == "BartForConditionalGeneration"
    assert (whole.info.encoder_layers, whole.info.n_layers) == (1, 1)


def test_a_checkpoint_that_loads_but_would_drop_its_encoder_is_refused(tmp_path: Path) -> None:
    """ProphetNet's causal LM finds every weight it needs in the sequence-to-sequence file:
    only the dropped encoder tells that the model is not the checkpoint's."""
    config = AutoConfig.for_model(
        "prophetnet", vocab_size=300, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=2,
        num_decoder_attention_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    AutoModelForSeq2SeqLM.from_config(config).save_pretrained(tmp_path / "prophetnet")
    folder = tmp_path / "prophetnet"
    needed, in_file = set(_needed_shapes(folder, {})), set(_file_shapes(folder))
    assert not needed - in_file
    placeless = in_file - needed
    assert placeless and all(k.startswith("prophetnet.encoder.") for k in placeless)
    with pytest.raises(ConfigError) as refused:
        HFDriver.boot(str(folder), model_class="ProphetNetForCausalLM")
    message = str(refused.value)
    assert f"no place for {len(placeless)} of its weights, its encoder among them" in message
    assert f"prophetnet.encoder ({len(placeless)} weights)" in message
    assert "ProphetNetForConditionalGeneration, a sequence-to-sequence model" in message
    # Booted plainly it is built whole, and its blocks, of a form tl does not know yet, are
    # refused by name rather than read as a decoder alone.
    with pytest.raises(ConfigError, match="tl does not know the blocks of the encoder"):
        HFDriver.boot(str(folder), tokenizer=ByteTokenizer())


def test_weights_of_layers_past_the_config_are_refused_naming_the_layer_count(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy_with_config(checkpoint("llama"), tmp_path / "one", num_hidden_layers=1)
    layer_1 = sorted(set(_file_shapes(folder)) - set(_needed_shapes(folder, {})))
    assert layer_1 and all(k.startswith("model.layers.1.") for k in layer_1)
    with pytest.raises(ConfigError) as refused:
        HFDriver.boot(str(folder))
    message = str(refused.value)
    assert f"model.layers.1 ({len(layer_1)} weights)" in message
    assert "The config has num_hidden_layers=1, but the weights hold 2 layers" in message
    with pytest.raises(ConfigError, match=r"hf_config_overrides set num_hidden_layers=1"):
        HFDriver.boot(str(checkpoint("llama")), hf_config_overrides={"num_hidden_layers": 1})


def test_a_weight_of_another_head_is_refused_naming_it(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tmp_path / "with-head"
    shutil.copytree(checkpoint("llama"), folder)
    weights = load_file(str(folder / WEIGHTS))
    save_file({**weights, "score.weight": torch.ones(3, 128)}, str(folder / WEIGHTS))
    with pytest.raises(ConfigError) as refused:
        HFDriver.boot(str(folder))
    message = str(refused.value)
    assert (
        "LlamaForCausalLM transformers builds for it has no place for one of its weights: score.weight"
        in message
    )
    assert "pass it as hf_model=" in message


def test_weights_a_class_declares_it_never_loads_are_no_refusal(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """GPT-2 checkpoints written by old transformers hold each layer's causal-mask buffer
    (``h.{i}.attn.bias``); GPT2LMHeadModel declares them never loaded."""
    from transformers import GPT2LMHeadModel

    assert "attn.bias" in GPT2LMHeadModel._keys_to_ignore_on_load_unexpected
    folder = tmp_path / "old-gpt2"
    shutil.copytree(checkpoint("gpt2"), folder)
    weights = load_file(str(folder / WEIGHTS))
    n_ctx = AutoConfig.from_pretrained(folder).n_positions
    masks = {
        f"transformer.h.{i}.attn.bias": torch.ones(1, 1, n_ctx, n_ctx).tril() for i in range(2)
    }
    save_file({**weights, **masks}, str(folder / WEIGHTS))
    driver = HFDriver.boot(str(folder), certify=False)
    held = driver.hf_model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in weights.items() if k in held)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_tiny_family_boots_whole(family: str, checkpoint: Callable[[str], Path]) -> None:
    """Tied embeddings (stored once), rotary tables and position ids (never stored) are not
    missing weights: every family's checkpoint boots, with the file's weights."""
    folder = checkpoint(family)
    driver = HFDriver.boot(str(folder), certify=False)
    held = driver.hf_model.state_dict()
    # Plain transformers loads at another point of the random stream: a weight either side
    # initialised instead of loading would differ.
    torch.manual_seed(1)
    reference = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(held) == set(reference)
    for key, tensor in reference.items():
        assert torch.equal(held[key], tensor), key
    stored = load_file(str(folder / WEIGHTS))  # names transformers keeps hold the file's values
    for key in set(stored) & set(held):
        assert torch.equal(held[key], stored[key]), key


# -- sizes that disagree -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "weight"),
    [
        ({"vocab_size": 600}, "model.embed_tokens.weight"),
        ({"hidden_size": 256}, "model.norm.weight"),
        ({"num_attention_heads": 8}, "self_attn.q_proj.weight"),
        ({"num_key_value_heads": 4}, "self_attn.k_proj.weight"),
        ({"intermediate_size": 100}, "mlp.up_proj.weight"),
    ],
    ids=["vocab", "width", "heads", "kv-heads", "mlp"],
)
def test_sizes_that_disagree_name_the_weight_both_shapes_and_the_override(
    overrides: dict[str, Any], weight: str, checkpoint: Callable[[str], Path]
) -> None:
    folder = checkpoint("llama")
    in_file = _file_shapes(folder)
    needed = _needed_shapes(folder, overrides)
    key = next(k for k in needed if k.endswith(weight))
    assert needed[key] != in_file[key]
    with pytest.raises(ConfigError) as refused:
        HFDriver.boot(str(folder), hf_config_overrides=overrides)
    message = str(refused.value)
    assert weight in message
    assert f"{list(in_file[key])} in the weights, {list(needed[key])} in the model" in message
    ((field, value),) = overrides.items()
    assert f"hf_config_overrides set {field}={value!r}" in message


def test_a_config_json_whose_vocabulary_disagrees_names_the_field(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy_with_config(checkpoint("gpt2"), tmp_path / "wide", vocab_size=700)
    with pytest.raises(
        ConfigError,
        match=r"(?s)wte\.weight: \[512, 128\] in the weights, \[700, 128\] in the model.*vocab_size=700",
    ):
        HFDriver.boot(str(folder))


_DISAGREEMENTS = st.fixed_dictionaries(
    {},
    optional={
        "num_hidden_layers": st.integers(1, 4),
        "hidden_size": st.sampled_from([64, 128, 192]),
        "vocab_size": st.sampled_from([500, 512, 520]),
        "intermediate_size": st.sampled_from([128, 256]),
    },
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(overrides=_DISAGREEMENTS)
def test_config_and_weights_either_agree_or_the_boot_names_what_disagrees(
    overrides: dict[str, Any], checkpoint: Callable[[str], Path]
) -> None:
    folder = checkpoint("llama")  # 2 layers, width 128, 512 tokens, MLP 256
    if overrides.get("hidden_size", 128) != 128:
        overrides["head_dim"] = overrides["hidden_size"] // 4  # heads tile the width
    in_file = _file_shapes(folder)
    needed = _needed_shapes(folder, overrides)
    missing = sorted(set(needed) - set(in_file))
    other_shape = sorted(k for k in needed if k in in_file and needed[k] != in_file[k])
    unused = sorted(set(in_file) - set(needed))
    if not missing and not other_shape and not unused:
        driver = HFDriver.boot(str(folder), hf_config_overrides=overrides, certify=False)
        stored = load_file(str(folder / WEIGHTS))
        held = driver.hf_model.state_dict()
        assert all(torch.equal(held[k], v) for k, v in stored.items() if k in held)
        return
    with pytest.raises(ConfigError) as refused:
        HFDriver.boot(str(folder), hf_config_overrides=overrides, certify=False)
    message = str(refused.value)
    if missing and not other_shape:
        layers = sorted({int(k.split(".")[2]) for k in missing})
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
        assert f"lacks {len(missing)} weights" in message and f"model.layers.{span}:" in message
    if unused and not other_shape:
        # Fewer layers than the weights hold: the others would be dropped.
        layers = sorted({int(k.split(".")[2]) for k in unused})
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
        assert f"model.layers.{span} ({len(unused)} weights)" in message, message
    for key in other_shape:
        assert key.rsplit(".", 2)[-2] in message, (key, message)
        assert f"{list(in_file[key])} in the weights, {list(needed[key])} in the model" in message


# -- architectures vs model_type -----------------------------------------------------------


def test_a_gemma_name_on_llama_weights_is_refused_naming_both(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy_with_config(
        checkpoint("llama"), tmp_path / "named-gemma", architectures=["GemmaForCausalLM"]
    )
    # What transformers builds from this config (the reference): a Llama model.
    assert type(AutoModelForCausalLM.from_pretrained(folder)).__name__ == "LlamaForCausalLM"
    with pytest.raises(
        ConfigError,
        match=r"(?s)contradicts itself.*'GemmaForCausalLM' \(model_type 'gemma'\).*model_type 'llama' makes transformers build 'LlamaForCausalLM'.*architectures \['LlamaForCausalLM'\]",
    ):
        TransformerBridge.boot_transformers(str(folder))


def test_the_description_follows_the_class_that_was_built(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy_with_config(
        checkpoint("llama"), tmp_path / "named-gemma", architectures=["GemmaForCausalLM"]
    )
    reference = AutoModelForCausalLM.from_pretrained(folder)
    embed = reference.get_input_embeddings().weight
    # Chosen explicitly, and passed in as a model: both describe the Llama that runs.
    chosen = TransformerBridge.boot_transformers(str(folder), model_class="LlamaForCausalLM")
    wrapped = TransformerBridge.boot_transformers(hf_model=reference, tokenizer=str(folder))
    for bridge in (chosen, wrapped):
        assert bridge.driver.adapter.family == "llama"
        assert bridge.architecture is not None and not bridge.architecture.embed_scaled
        torch.testing.assert_close(bridge.W_E, embed, rtol=0, atol=0)
        ids = torch.tensor([[1, 7, 9, 30]])
        with torch.no_grad():
            want = reference(input_ids=ids).logits
        torch.testing.assert_close(bridge(ids), want, rtol=1e-5, atol=1e-5)
    assert isinstance(wrapped.driver.hf_model, LlamaForCausalLM)


# -- tiny latent-attention checkpoints ------------------------------------------------------


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"])
def test_tiny_latent_attention_checkpoints_run_in_transformers(
    model_type: str, tmp_path: Path
) -> None:
    folder = write_tiny_default_checkpoint(model_type, tmp_path / model_type)
    config = AutoConfig.from_pretrained(folder)
    assert config.qk_rope_head_dim + config.qk_nope_head_dim == config.qk_head_dim <= 16
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, 5, config.vocab_size) and bool(torch.isfinite(logits).all())
    bridge = TransformerBridge.boot_transformers(str(folder))
    torch.testing.assert_close(bridge(ids), logits, rtol=1e-4, atol=1e-4)


def test_a_checkpoint_transformers_cannot_run_is_a_config_error(tmp_path: Path) -> None:
    folder = write_tiny_default_checkpoint("deepseek_v3", tmp_path / "v3")
    # Latent attention has one key/value head per query head; two groups do not fit.
    with pytest.raises(ConfigError, match=r"transformers cannot run this DeepseekV3ForCausalLM"):
        HFDriver.boot(str(folder), hf_config_overrides={"num_key_value_heads": 2})
