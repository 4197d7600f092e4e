"""Shared fixtures: tiny offline checkpoints of every family, bridges and eager references.

Checkpoints are written once per session into a temporary folder with
``tl_driver_hf.testing.write_tiny_checkpoint``; nothing touches the network.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from tl_core import TransformerBridge
from tl_driver_hf.testing import write_tiny_checkpoint

# Where each family keeps its parts, written out independently of the driver's adapters:
# the parity tests locate reference values with these paths. Adding a family to the
# driver's tests is one entry here (keyed by its tiny-checkpoint name).
# Roles: embed, pos (learned positions), layers, final (norm), head; per layer ln1, ln2,
# ln1_post, ln2_post, attn, q/k/v or qkv (fused, [q|k|v]), o, mlp, pre (gate or input
# projection), pre_linear (up), gate_up (fused [gate|up]), down; flags: rotary, conv1d
# (weights stored [in, out]), norm ("layernorm", "rms" or "rms_plus_one").
_LLAMA = {
    "embed": "model.embed_tokens",
    "layers": "model.layers",
    "final": "model.norm",
    "head": "lm_head",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "attn": "self_attn",
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "mlp": "mlp",
    "pre": "gate_proj",
    "pre_linear": "up_proj",
    "down": "down_proj",
    "rotary": True,
    "norm": "rms",
}
_SANDWICH = {
    **_LLAMA,
    "ln1_post": "post_attention_layernorm",
    "ln2": "pre_feedforward_layernorm",
    "ln2_post": "post_feedforward_layernorm",
}
PATHS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "embed": "transformer.wte",
        "pos": "transformer.wpe",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "ln_1",
        "ln2": "ln_2",
        "attn": "attn",
        "qkv": "c_attn",
        "o": "c_proj",
        "mlp": "mlp",
        "pre": "c_fc",
        "down": "c_proj",
        "conv1d": True,
        "rotary": False,
        "norm": "layernorm",
    },
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mixtral": {k: v for k, v in _LLAMA.items() if k not in ("pre", "pre_linear", "down")},
    "phi3": {
        **{k: v for k, v in _LLAMA.items() if k not in ("q", "k", "v", "pre", "pre_linear")},
        "qkv": "qkv_proj",
        "gate_up": "gate_up_proj",
    },
    "gemma": {**_LLAMA, "norm": "rms_plus_one"},
    "gemma2": {**_SANDWICH, "norm": "rms_plus_one"},
    "gemma3": {**_SANDWICH, "norm": "rms_plus_one"},
    "stablelm": {**_LLAMA, "norm": "layernorm"},
    "olmo2": {
        **{k: v for k, v in _LLAMA.items() if k not in ("ln1", "ln2")},
        "ln1_post": "post_attention_layernorm",
        "ln2_post": "post_feedforward_layernorm",
    },
    "gpt_neox": {
        "embed": "gpt_neox.embed_in",
        "layers": "gpt_neox.layers",
        "final": "gpt_neox.final_layer_norm",
        "head": "lm_head",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
        "attn": "attention",
        "qkv": "query_key_value",
        "qkv_per_head": True,
        "o": "dense",
        "mlp": "mlp",
        "pre": "dense_h_to_4h",
        "down": "dense_4h_to_h",
        "rotary": True,
        "parallel": True,
        "norm": "layernorm",
    },
    "gptj": {
        "embed": "transformer.wte",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "ln_1",
        "attn": "attn",
        "q": "q_proj",
        "k": "k_proj",
        "v": "v_proj",
        "o": "out_proj",
        "mlp": "mlp",
        "pre": "fc_in",
        "down": "fc_out",
        "rotary": True,
        "parallel": True,
        "norm": "layernorm",
    },
    "opt": {
        "embed": "model.decoder.embed_tokens",
        "pos": "model.decoder.embed_positions",
        "pos_offset": 2,
        "layers": "model.decoder.layers",
        "final": "model.decoder.final_layer_norm",
        "head": "lm_head",
        "ln1": "self_attn_layer_norm",
        "ln2": "final_layer_norm",
        "attn": "self_attn",
        "q": "q_proj",
        "k": "k_proj",
        "v": "v_proj",
        "o": "out_proj",
        "mlp": "",
        "mlp_inline": True,
        "flat_mlp": True,
        "pre": "fc1",
        "down": "fc2",
        "prescaled": True,
        "rotary": False,
        "norm": "layernorm",
    },
    # Families computing attention inside their modules; "inline" names how
    # tests/_inline_reference.py recomputes their attention internals.
    "gpt_neo": {
        "embed": "transformer.wte",
        "pos": "transformer.wpe",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "ln_1",
        "ln2": "ln_2",
        "attn": "attn.attention",
        "q": "q_proj",
        "k": "k_proj",
        "v": "v_proj",
        "o": "out_proj",
        "mlp": "mlp",
        "pre": "c_fc",
        "down": "c_proj",
        "rotary": False,
        "norm": "layernorm",
        "inline": "gpt_neo",
    },
    "bloom": {
        "embed": "transformer.word_embeddings",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
        "attn": "self_attention",
        "qkv": "query_key_value",
        "o": "dense",
        # The attention and MLP modules add the residual themselves.
        "attn_out": "dense",
        "mlp": "mlp",
        "mlp_out": "dense_4h_to_h",
        "pre": "dense_h_to_4h",
        "down": "dense_4h_to_h",
        "rotary": False,
        "norm": "layernorm",
        "inline": "bloom",
    },
    "falcon": {
        "embed": "transformer.word_embeddings",
        "layers": "transformer.h",
        "final": "transformer.ln_f",
        "head": "lm_head",
        "ln1": "input_layernorm",
        "attn": "self_attention",
        "qkv": "query_key_value",
        "n_kv": 1,
        "o": "dense",
        "mlp": "mlp",
        "pre": "dense_h_to_4h",
        "down": "dense_4h_to_h",
        "rotary": True,
        "parallel": True,
        "norm": "layernorm",
        "inline": "falcon",
    },
}


#: Every family this package's adapters serve, by tiny-checkpoint family name.
FAMILIES = tuple(PATHS)


@pytest.fixture(autouse=True, scope="session")
def _offline() -> Iterator[None]:
    # The hub reads the variable once at import, so its constant is patched as well: any
    # attempt to reach the network during a test then fails.
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hf_logging.disable_progress_bar()
    # Tiny models run many times faster on one thread than with threads contending.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    patch.undo()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session folder holding the tiny checkpoints."""
    return tmp_path_factory.mktemp("tiny-hf")


@pytest.fixture(scope="session")
def checkpoint(checkpoint_root: Path) -> Callable[[str], Path]:
    """``checkpoint(family)`` -> the folder of a float32 tiny checkpoint (written once)."""
    written: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in written:
            written[family] = write_tiny_checkpoint(family, checkpoint_root / family)
        return written[family]

    return get


@pytest.fixture(scope="session")
def bridge_of(checkpoint: Callable[[str], Path]) -> Callable[[str], TransformerBridge]:
    """``bridge_of(family)`` -> a cached bridge with ``use_attn_result=True``."""
    cache: dict[str, TransformerBridge] = {}

    def get(family: str) -> TransformerBridge:
        if family not in cache:
            cache[family] = TransformerBridge.boot_transformers(
                str(checkpoint(family)), use_attn_result=True
            )
        return cache[family]

    return get


@pytest.fixture(scope="session")
def reference_of(checkpoint: Callable[[str], Path]) -> Callable[[str], PreTrainedModel]:
    """``reference_of(family)`` -> the plain transformers model with eager attention."""
    cache: dict[str, PreTrainedModel] = {}

    def get(family: str) -> PreTrainedModel:
        if family not in cache:
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint(family), attn_implementation="eager"
            )
            cache[family] = model.eval()
        return cache[family]

    return get


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    """Each supported family in turn."""
    return str(request.param)


@pytest.fixture
def paths(family: str) -> dict[str, Any]:
    """The current family's module paths and flags (see ``PATHS``)."""
    return PATHS[family]


@pytest.fixture
def bridge(family: str, bridge_of: Callable[[str], TransformerBridge]) -> TransformerBridge:
    """The bridge of the current family."""
    return bridge_of(family)


@pytest.fixture
def reference(family: str, reference_of: Callable[[str], PreTrainedModel]) -> PreTrainedModel:
    """The eager transformers model of the current family."""
    return reference_of(family)


@pytest.fixture
def ids() -> torch.Tensor:
    """A batch of two random 11-token prompts (no padding)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(4, 500, (2, 11), generator=generator)
