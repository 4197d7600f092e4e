"""Tests of tl_driver_hf.testing: tiny offline checkpoints and the tiny tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from tl_driver_hf.testing import (
    TINY_FAMILIES,
    tiny_config,
    train_tiny_tokenizer,
    write_tiny_checkpoint,
)
from tl_driver_hf.testing._families import FAMILIES, VLLM_CPU_HEAD_SIZES

SENTENCE = "The keeper climbed the stairs at dusk and wrote: wind north-west, force 4."
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
GQA_FAMILIES = [f for f in TINY_FAMILIES if FAMILIES[f].kv == "gqa"]
MQA_FAMILIES = [f for f in TINY_FAMILIES if FAMILIES[f].kv == "mqa"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # The hub reads the variable once at import, so its constant is patched as well: any
    # attempt to reach the network during a test then fails.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One float32 checkpoint per family, seed 0, written once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: write_tiny_checkpoint(family, root / family) for family in TINY_FAMILIES}


def _head_dim(config: PretrainedConfig) -> int:
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    return int(config.hidden_size) // int(config.num_attention_heads)


def _rope_thetas(config: PretrainedConfig) -> list[float]:
    params = getattr(config, "rope_parameters", None) or {}
    nested = [value for value in params.values() if isinstance(value, dict)]
    return [float(p["rope_theta"]) for p in (nested or [params]) if "rope_theta" in p]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_checkpoint_loads_offline_and_runs(family: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[family]
    assert {p.name for p in path.iterdir()} >= EXPECTED_FILES
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == FAMILIES[family].model_class
    assert type(model.config).__name__ == FAMILIES[family].config_class
    assert model.dtype == torch.float32
    assert len(tokenizer) == model.config.vocab_size == 512
    assert tokenizer.model_max_length == 256

    ids = tokenizer(SENTENCE, return_tensors="pt").input_ids
    assert ids.shape[1] > 8
    assert ids[0].tolist() == train_tiny_tokenizer().encode(SENTENCE)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()
    # Degenerate weights give one argmax everywhere; a usable fixture varies with position.
    assert len(set(logits[0].argmax(-1).tolist())) > 1
    assert logits.std().item() > 0.1


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_checkpoint_token_ids_and_generation(family: str, checkpoints: dict[str, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(checkpoints[family])
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[family])
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(model.config, attr) == getattr(tokenizer, attr), attr
        assert getattr(model.generation_config, attr) == getattr(tokenizer, attr), attr
    ids = tokenizer("The river", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (1, ids.shape[1] + 4)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_config_shapes(family: str) -> None:
    config = tiny_config(family)
    head_dim = _head_dim(config)
    assert head_dim >= 32
    assert head_dim in VLLM_CPU_HEAD_SIZES
    assert head_dim == 32
    assert config.num_hidden_layers == 2
    assert config.num_attention_heads == 4
    assert config.vocab_size == 512
    kv_heads = getattr(config, "num_key_value_heads", None)
    if family in GQA_FAMILIES:
        assert kv_heads == 2
    elif family == "gemma":
        assert kv_heads == 1
    elif family == "falcon":
        assert config.multi_query and not config.new_decoder_architecture
    window = getattr(config, "sliding_window", None) or getattr(config, "window_size", None)
    if window is not None:
        assert window >= 256
    thetas = _rope_thetas(config)
    assert all(theta == 10_000.0 for theta in thetas)


def test_tiny_config_family_specifics() -> None:
    mixtral = tiny_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    gemma2 = tiny_config("gemma2")
    assert gemma2.attn_logit_softcapping == 50.0
    assert gemma2.final_logit_softcapping == 30.0
    assert gemma2.query_pre_attn_scalar == 32
    gemma3 = tiny_config("gemma3")
    assert gemma3.model_type == "gemma3_text"
    assert gemma3.layer_types == ["sliding_attention", "full_attention"]
    assert len(_rope_thetas(gemma3)) == 2
    for family in ("llama", "qwen2", "phi3", "gemma2", "falcon", "gpt_neox"):
        assert _rope_thetas(tiny_config(family)) == [10_000.0], family
    assert tiny_config("gpt_neo", n_layers=3).attention_layers == ["global", "local", "global"]
    assert tiny_config("gpt2").tie_word_embeddings
    assert not tiny_config("llama").tie_word_embeddings


def test_tiny_config_sizes_and_overrides() -> None:
    wide = tiny_config("llama", n_heads=8, head_dim=64, n_layers=3, vocab_size=300, n_ctx=64)
    assert (wide.hidden_size, wide.num_attention_heads, wide.head_dim) == (512, 8, 64)
    assert (wide.num_key_value_heads, wide.num_hidden_layers) == (4, 3)
    assert (wide.vocab_size, wide.max_position_embeddings) == (300, 64)
    # Families with their own head_dim field may have d_model != n_heads * head_dim.
    decoupled = tiny_config("gemma2", d_model=96, n_heads=4)
    assert (decoupled.hidden_size, decoupled.head_dim) == (96, 32)
    assert tiny_config("gpt2", d_model=192).n_head == 6
    overridden = tiny_config("llama", overrides={"tie_word_embeddings": True, "rms_norm_eps": 0.1})
    assert overridden.tie_word_embeddings
    assert overridden.rms_norm_eps == 0.1
    assert tiny_config("qwen3", dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_dim": 16}, "head_dim=16 is not a head size"),
        ({"d_model": 100, "n_heads": 4}, "d_model must be n_heads \\* head_dim = 128"),
        ({"d_model": 100}, "not a multiple of head_dim=32"),
        ({"vocab_size": 100}, "vocab_size must be an int >= 260"),
        ({"n_layers": 0}, "n_layers must be an int >= 1"),
        ({"dtype": "float16"}, "unsupported dtype 'float16'"),
    ],
)
def test_tiny_config_rejects_bad_sizes(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("qwen2", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("family", "suggestion"), [("gpt-neox", "gpt_neox"), ("llama2", "llama"), ("Gemma_3", "gemma3")]
)
def test_unknown_family_lists_and_suggests(family: str, suggestion: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        write_tiny_checkpoint(family, tmp_path / "x")
    message = str(info.value)
    assert repr(family) in message
    assert all(name in message for name in TINY_FAMILIES)
    assert f"did you mean {suggestion!r}?" in message
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="unknown tiny model family 'zzzz'; expected one of"):
        tiny_config("zzzz")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_same_seed_same_bytes_other_seed_other_weights(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    rng_before = torch.get_rng_state()
    again = write_tiny_checkpoint(family, tmp_path / "again", seed=0)
    other = write_tiny_checkpoint(family, tmp_path / "other", seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before)

    reference = load_file(checkpoints[family] / "model.safetensors")
    same = load_file(again / "model.safetensors")
    assert reference.keys() == same.keys()
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (checkpoints[family] / name).read_bytes(), name

    different = load_file(other / "model.safetensors")
    assert different.keys() == reference.keys()
    assert any(not torch.equal(reference[k], different[k]) for k in reference)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_bfloat16_checkpoint_is_the_rounded_float32_one(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = write_tiny_checkpoint(family, tmp_path / "bf16", dtype="bfloat16")
    reference = load_file(checkpoints[family] / "model.safetensors")
    tensors = load_file(path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert all(torch.equal(tensors[k], reference[k].to(torch.bfloat16)) for k in reference)

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor([[5, 70, 300, 9, 41]])).logits
    assert torch.isfinite(logits).all()


def test_norm_weights_and_biases_are_not_constant(checkpoints: dict[str, Path]) -> None:
    for family in ("gpt2", "llama", "gemma2", "olmo2", "bloom"):
        tensors = load_file(checkpoints[family] / "model.safetensors")
        norms = [k for k in tensors if "norm" in k or ".ln_" in k]
        assert norms, family
        for name in norms + [k for k in tensors if k.endswith(".bias")]:
            flat = tensors[name].flatten()
            assert not torch.all(flat == flat[0]), f"{family}: {name} is constant"


def test_existing_folder_is_refused_and_empty_one_is_used(tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        write_tiny_checkpoint("gpt2", busy)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_tiny_checkpoint("gpt2", empty) == empty
    assert {p.name for p in empty.iterdir()} >= EXPECTED_FILES

    nested = write_tiny_checkpoint("gpt2", str(tmp_path / "a" / "b"))
    assert nested == tmp_path / "a" / "b" and nested.is_absolute()


def test_interrupted_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def save_then_fail(self: torch.nn.Module, directory: str | os.PathLike[str]) -> None:
        (Path(directory) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_then_fail)
    with pytest.raises(KeyboardInterrupt):
        write_tiny_checkpoint("llama", tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_written_folder_is_not_private(tmp_path: Path) -> None:
    path = write_tiny_checkpoint("gpt2", tmp_path / "tiny")
    assert path.stat().st_mode & 0o077 == (0o777 & ~_umask()) & 0o077


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


@pytest.mark.parametrize(
    "text",
    [
        SENTENCE,
        "",
        "  leading and  double  spaces\n\ttabs and\r\nnewlines  ",
        "Ünïcödé — naïve café, 日本語, emoji 🙂, and 3.14159 digits",
        "def add(a, b):\n    return a + b\n",
    ],
)
def test_tokenizer_round_trips(text: str) -> None:
    tokenizer = train_tiny_tokenizer()
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids


def test_tokenizer_special_tokens_and_sizes() -> None:
    tokenizer = train_tiny_tokenizer(512)
    specials = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert specials == (0, 1, 2)
    assert tokenizer.unk_token_id == 3
    assert len(tokenizer) == 512
    # No special tokens are added when encoding, like GPT-2.
    assert tokenizer.encode("hello")[0] not in specials
    # The built-in corpus fills 512 with learned merges; larger sizes get reserved tokens.
    assert not any("reserved" in token for token in tokenizer.get_vocab())
    assert len(tokenizer.encode(SENTENCE)) < 0.6 * len(SENTENCE)
    assert len(train_tiny_tokenizer(260)) == 260
    large = train_tiny_tokenizer(1000)
    assert len(large) == 1000
    assert large.convert_ids_to_tokens(999) == "<|reserved_999|>"
    with pytest.raises(ValueError, match="use at least 260"):
        train_tiny_tokenizer(259)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(chat, str)
    assert chat.startswith("<|bos|>") and "hi" in chat


def test_tokenizer_is_deterministic_and_not_shared() -> None:
    first = train_tiny_tokenizer(512)
    second = train_tiny_tokenizer(512)
    assert first is not second
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    first.add_tokens(["<|only_in_first|>"])
    assert len(second) == 512
    assert len(train_tiny_tokenizer(512)) == 512
