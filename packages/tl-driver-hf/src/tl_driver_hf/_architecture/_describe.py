"""The description the hf driver serves an architecture with, read without its weights.

Other engines that run transformers' own modules (vLLM's Transformers backend) place tl's
sites by the hf driver's description of the same architecture. For a family with an
adapter that is the adapter; for one nobody described it is inferred and certified on a
shrunk copy of the checkpoint's architecture (two layers, width 64, random weights), so a
checkpoint of any size is described in about a second on the CPU, before its engine starts.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from tl_core.certification import Certification
from tl_driver_hf.adapters import ArchitectureAdapter, find_adapter

__all__ = [
    "SHRUNK_SIZES",
    "ArchitectureDescription",
    "describe_architecture",
    "shrunk_model",
    "widen_weights",
]

#: The sizes a shrunk copy takes, where its config has the field (others stay as they are).
SHRUNK_SIZES: Final[dict[str, int]] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "head_dim": 16,
    "vocab_size": 512,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "state_size": 8,
    "time_step_rank": 8,
}


def shrunk_model(
    config: Any, *, sizes: dict[str, int] | None = None, seed: int = 0
) -> PreTrainedModel:
    """A tiny float32 causal LM with ``config``'s architecture and ``sizes`` (default
    ``SHRUNK_SIZES``).

    Special token ids past the tiny vocabulary are dropped and per-layer ``layer_types``
    cut to the layer count. Matrices are drawn with std ``hidden_size ** -0.5`` and vectors
    (norm weights, biases) jittered by 0.1, from a generator seeded with ``seed`` (the
    usual std 0.02 leaves attention near uniform, so a wrong tensor would not show).

    Args:
        config: A ``transformers`` config (copied, never changed).
        sizes: Config fields to set where the config has them.
        seed: The weights' seed.

    Returns:
        The model, in eval mode.
    """
    config = copy.deepcopy(config)
    sizes = SHRUNK_SIZES if sizes is None else sizes
    rope_is_head_dim = _rope_is_head_dim(config)
    for key, value in sizes.items():
        if hasattr(config, key):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, value)
    _shrink_latent_attention(config, sizes, rope_is_head_dim=rope_is_head_dim)
    if getattr(config, "multi_query", False) and hasattr(config, "num_key_value_heads"):
        # GPT-BigCode: multi-query means one key/value head; a second count would disagree
        # with it, and vLLM reads the count where transformers reads multi_query.
        config.num_key_value_heads = 1
    vocab = int(getattr(config, "vocab_size", sizes.get("vocab_size", 512)))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= vocab:
            setattr(config, key, None)
    layer_types = getattr(config, "layer_types", None)
    n_layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layer_types, list) and isinstance(n_layers, int):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            config.layer_types = layer_types[:n_layers]
    torch.manual_seed(seed)
    build: Any = AutoModelForCausalLM.from_config  # untyped in transformers
    model: PreTrainedModel = build(config, dtype=torch.float32).eval()
    widen_weights(model, int(getattr(config, "hidden_size", 64)), seed)
    return model


def widen_weights(model: nn.Module, width: int, seed: int) -> None:
    """Redraw ``model``'s matrices with std ``width ** -0.5`` and jitter its vectors (norm
    weights, biases) by 0.1, from a generator seeded with ``seed``: with transformers' std
    0.02 attention stays near uniform and logits near 0, so a wrong tensor would not show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if param.dim() >= 2:
                param.copy_(noise * width**-0.5)
            else:
                param.add_(noise * 0.1)


def _rope_is_head_dim(config: Any) -> bool:
    """Whether a latent-attention config's ``head_dim`` is its rotary part (DeepSeek-V2/V3
    set it so; GLM-4-MoE-Lite maps the name onto ``qk_rope_head_dim``)."""
    rope = getattr(config, "qk_rope_head_dim", None)
    return isinstance(rope, int) and getattr(config, "head_dim", None) == rope


def _shrink_latent_attention(config: Any, sizes: dict[str, int], *, rope_is_head_dim: bool) -> None:
    """Shrink multi-head latent attention's own head sizes consistently with ``sizes``.

    Its heads are ``qk_nope_head_dim + qk_rope_head_dim`` wide (``qk_head_dim``), values
    ``v_head_dim``, and every head has its own key and value (``kv_b_proj`` writes all of
    them): left at their defaults next to a shrunk ``head_dim``, the rotary tables and the
    key/value head count disagree with the projections and transformers cannot run it.
    """
    if (
        "head_dim" not in sizes
        or not isinstance(getattr(config, "qk_rope_head_dim", None), int)
        or not isinstance(getattr(config, "kv_lora_rank", None), int)
    ):
        return  # not latent attention, or head sizes are not being shrunk
    head = int(sizes["head_dim"])
    rope = max(2, head // 2 - (head // 2) % 2)  # rotary halves need an even width
    lora = 2 * head
    fields: dict[str, Any] = {
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": head - rope,
        "v_head_dim": head,
        "kv_lora_rank": lora,
    }
    if isinstance(getattr(config, "q_lora_rank", None), int):
        fields["q_lora_rank"] = lora
    if isinstance(getattr(config, "index_head_dim", None), int):
        fields["index_head_dim"] = head
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(getattr(config, "index_n_heads", None), int) and isinstance(heads, int):
        fields["index_n_heads"] = heads
    for key, value in fields.items():
        if key not in sizes:  # a size the caller set stays
            setattr(config, key, value)
    if isinstance(heads, int) and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = heads  # not a size: the layout needs one per head
    if hasattr(config, "qk_head_dim"):  # derived in the config's __init__, so stale here
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if rope_is_head_dim:
        config.head_dim = config.qk_rope_head_dim


@dataclass(frozen=True)
class ArchitectureDescription:
    """How the hf driver serves one architecture.

    Attributes:
        adapter: Where each canonical site lives in transformers' modules (hand-written,
            or inferred from the module tree).
        inferred: Whether nobody described the architecture.
        level: What certification proved on the shrunk copy: ``"full"`` (attention and MLP
            sites), ``"sublayers"`` or ``"residual"``; ``"full"`` for a described family.
        certification: The report of the shrunk copy (``None`` for a described family,
            whose parity tests vouch for it).
    """

    adapter: ArchitectureAdapter
    inferred: bool
    level: Literal["full", "sublayers", "residual"]
    certification: Certification | None

    @property
    def certified(self) -> frozenset[str]:
        """Canonical names certified on the shrunk copy (empty for a described family)."""
        if self.certification is None:
            return frozenset()
        return frozenset(n for n, c in self.certification.statuses.items() if c.status == "real")


def describe_architecture(config: Any) -> ArchitectureDescription:
    """The description the hf driver serves ``config``'s architecture with.

    Args:
        config: A checkpoint's ``transformers`` config (not changed).

    Returns:
        Its adapter when a family describes it; else the description inferred and certified
        on a shrunk copy.

    Raises:
        ConfigError: transformers cannot build the architecture, or the hf driver refuses
            the inferred description (the message names the failing equation).
    """
    adapter = find_adapter(
        getattr(config, "model_type", None), getattr(config, "architectures", None)
    )
    if adapter is not None:
        return ArchitectureDescription(adapter, inferred=False, level="full", certification=None)
    from tl_driver_hf._driver import HFDriver

    model = shrunk_model(config)
    log = logging.getLogger("tl_driver_hf")
    level = log.level
    log.setLevel(logging.ERROR)  # the copy's boot line would read as the checkpoint's
    try:
        driver = HFDriver.boot(hf_model=model, use_attn_result=True)  # hook_result's status too
    finally:
        log.setLevel(level)
    cert = driver.certification
    assert cert is not None, "an inferred architecture is always certified at boot"
    return ArchitectureDescription(
        driver.adapter, inferred=True, level=cert.level, certification=cert
    )
