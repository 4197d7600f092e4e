"""What both TransformerLens comparison modules share: the families and how each tool boots.

Imported by name: ``conftest.py`` puts this folder on ``sys.path`` (the tests run in
importlib mode).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from tl_core import TransformerBridge

#: Every family tl's hf driver and TransformerLens 4.3 both boot.
FAMILIES = [
    "gpt2",
    "gpt_neo",
    "gptj",
    "gpt_neox",
    "opt",
    "bloom",
    "falcon",
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "stablelm",
]

#: Checkpoint variants whose structure changes what compatibility mode does:
#: name -> (family, config overrides).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_neox_sequential": ("gpt_neox", {"use_parallel_residual": False}),
    "gemma3_softcapped": ("gemma3", {"final_logit_softcapping": 30.0}),
}
#: Every checkpoint the comparisons run on.
CHECKPOINTS = [*FAMILIES, *VARIANTS]

#: Families TransformerLens 4.3 boots that no tl adapter describes: tl infers and certifies
#: them at boot (issue #18). Compared as loaded only: tl refuses compatibility mode on an
#: inferred architecture (its folding is verified for described families). TransformerLens
#: 4.3's bridge does not boot Helium, Ministral or DeepSeek-V3 checkpoints built from their
#: default configs.
INFERRED = [
    "granite",
    "smollm3",
    "seed_oss",
    "internlm3",
    "glm4",
    "starcoder2",
    "gpt_bigcode",
    "phi",
    "olmo3",
    "exaone4",
    "qwen3_moe",
    "olmoe",
    "cohere",
    "cohere2",
    "olmo",
    "granitemoe",
    "gpt_oss",
    "qwen2_moe",
]


#: Masked LMs (encoders) tl infers and certifies, with TransformerLens 4.3's adapter for each:
#: BERT-style post-LN blocks, compared as loaded (TransformerLens folds no norm of theirs,
#: and tl refuses compatibility mode on an inferred architecture).
MASKED = ["bert", "roberta"]


def write_masked_checkpoint(model_type: str, folder: Path, tokenizer_from: Path) -> Path:
    """A tiny random masked LM of ``model_type`` (``BertForMaskedLM``,
    ``RobertaForMaskedLM``) with the tiny tokenizer of ``tokenizer_from``; weights widened
    as ``write_inferred_checkpoint``'s are."""

    from transformers import AutoConfig, AutoModelForMaskedLM

    sizes = {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "max_position_embeddings": 64,
    }  # fmt: skip
    # RoBERTa numbers positions after its padding id (1), which the prompts never hold.
    extra = {"pad_token_id": 1} if model_type == "roberta" else {}
    config = AutoConfig.for_model(model_type, **sizes, **extra)
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(config).eval()
    return _save_widened(model, folder, tokenizer_from, width=sizes["hidden_size"])


def _save_widened(model: Any, folder: Path, tokenizer_from: Path, *, width: int) -> Path:
    """Save ``model`` with its matrices drawn with std ``width ** -0.5`` and its vectors
    (norm weights, biases) jittered by 0.1 (a wrong tensor shows), beside the tiny tokenizer
    of ``tokenizer_from``."""
    import shutil

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() >= 2:
                param.copy_(noise * width**-0.5)
            else:
                param.add_(noise * 0.1)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


#: Vision-language models TransformerLens 4.3 boots: tl serves their language stack and
#: takes their images. Their language model is the family in parentheses.
VISION_LANGUAGE = {"llava": "llama"}
#: The image token of the tiny vision-language checkpoints, and the pixels one image has.
IMAGE_TOKEN = 500
IMAGE_SHAPE = (3, 32, 32)


def write_llava_checkpoint(folder: Path, tokenizer_from: Path) -> Path:
    """A tiny random LLaVA (a CLIP tower on 32 x 32 pixels, a Llama of width 64) with the
    tiny tokenizer of ``tokenizer_from``; weights widened as ``write_masked_checkpoint``'s."""

    from transformers import LlavaConfig, LlavaForConditionalGeneration

    text = {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }  # fmt: skip
    vision = {
        "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": IMAGE_SHAPE[1],
        "patch_size": 8,
    }  # fmt: skip
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    return _save_widened(model, folder, tokenizer_from, width=text["hidden_size"])


def write_inferred_checkpoint(model_type: str, folder: Path, tokenizer_from: Path) -> Path:
    """A tiny random checkpoint of ``model_type`` from its default config, with the tiny
    tokenizer of ``tokenizer_from`` (TransformerLens loads one); weights are widened from
    the default initialisation so that a wrong tensor shows."""
    import shutil

    from tl_driver_hf.testing import tiny_default_model

    model = tiny_default_model(model_type)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


def family_of(checkpoint: str) -> str:
    """The family a checkpoint (or variant) name belongs to (a vision-language model's: its
    language model's)."""
    if checkpoint in VISION_LANGUAGE:
        return VISION_LANGUAGE[checkpoint]
    return VARIANTS[checkpoint][0] if checkpoint in VARIANTS else checkpoint


#: The two ways of running each family: as loaded, and after each tool's
#: ``enable_compatibility_mode()`` (folded norms, centred writers and unembedding).
MODES = {"plain": False, "compatibility_mode": True}


def boot_theirs(folder: Path, compat: bool, dtype: torch.dtype = torch.float32) -> Any:
    """TransformerLens 4.3's bridge on ``folder``, after its compatibility mode if asked."""
    from transformer_lens.model_bridge import TransformerBridge as TLBridge

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TLBridge.boot_transformers(str(folder), device="cpu", dtype=dtype)
        if dtype == torch.float64:
            # transformers' grouped expert kernel takes no float64: use its per-expert loop.
            for module in bridge.modules():
                if callable(getattr(module, "set_experts_implementation", None)):
                    module.set_experts_implementation("eager")
        if compat:
            bridge.enable_compatibility_mode(disable_warnings=True)
    return bridge


def boot_ours(folder: Path, compat: bool) -> TransformerBridge:
    """tl's hf bridge on ``folder``, after its compatibility mode if asked."""
    bridge = TransformerBridge.boot_transformers(str(folder))
    if compat:
        bridge.enable_compatibility_mode()
    return bridge


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want|`` over ``max(1, max |want|)``; ``inf`` when the shapes differ."""
    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    if not want.numel():
        return 0.0
    got, want = got.detach().float(), want.detach().float()
    scale = max(1.0, float(want.abs().max()))
    return float((got - want).abs().max()) / scale
