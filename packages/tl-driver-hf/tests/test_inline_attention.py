"""Families whose attention is re-implemented in ``_inline_attention`` (GPT-Neo, BLOOM; Falcon
before transformers 5.25)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.falcon.modeling_falcon import FalconAttention

from tl_core import ConfigError, TransformerBridge

#: Falcon's attention calls ``AttentionInterface`` from transformers 5.25 (no ``_split_heads``).
FALCON_INLINE = hasattr(FalconAttention, "_split_heads")
INLINE = ("gpt_neo", "bloom", "falcon") if FALCON_INLINE else ("gpt_neo", "bloom")


def _attention_modules(bridge: TransformerBridge) -> list[torch.nn.Module]:
    return [layer.attn for layer in bridge.driver.module.parts.layers]


@pytest.mark.parametrize("family", INLINE)
def test_forward_is_replaced_only_during_a_run(
    family: str, bridge_of: Callable[[str], TransformerBridge]
) -> None:
    bridge = bridge_of(family)
    seen: list[bool] = []

    def probe(x: torch.Tensor, hook: object) -> None:
        seen.append("forward" in vars(_attention_modules(bridge)[0]))

    bridge.run_with_hooks(
        torch.tensor([[1, 5, 9, 13]]), fwd_hooks=[("blocks.0.attn.hook_pattern", probe)]
    )
    assert seen == [True]
    assert not any("forward" in vars(m) for m in _attention_modules(bridge))

    def boom(x: torch.Tensor, hook: object) -> None:
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        bridge.run_with_hooks(torch.tensor([[1, 5, 9]]), fwd_hooks=[("blocks.0.attn.hook_z", boom)])
    assert not any("forward" in vars(m) for m in _attention_modules(bridge))


@pytest.mark.parametrize("family", (*INLINE, "falcon") if not FALCON_INLINE else INLINE)
def test_bfloat16_equals_eager_transformers(family: str, checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint(family)
    bridge = TransformerBridge.boot_transformers(str(path), dtype="bfloat16")
    reference = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([[1, 40, 50, 60, 70, 80]])
    with torch.no_grad():
        expected = reference(ids, use_cache=False).logits
        logits, cache = bridge.run_with_cache(ids)
    assert cache["blocks.0.attn.hook_pattern"].shape == (1, bridge.cfg.n_heads, 6, 6)
    torch.testing.assert_close(logits.float(), expected.float(), atol=0.0, rtol=0.0)


def test_gpt_neo_local_layers_use_their_window(checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("gpt_neo")
    window = 3
    bridge = TransformerBridge.boot_transformers(
        str(path), hf_config_overrides={"window_size": window}
    )
    reference = AutoModelForCausalLM.from_pretrained(
        path, window_size=window, attn_implementation="eager"
    ).eval()
    local = [i for i, kind in enumerate(reference.config.attention_layers) if kind == "local"]
    assert local, "the tiny GPT-Neo should alternate global and local layers"
    ids = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids, use_cache=False).logits
        logits, cache = bridge.run_with_cache(
            ids, names_filter=lambda n: n.endswith(("hook_pattern", "hook_attn_scores"))
        )
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    q, k = torch.arange(9)[:, None], torch.arange(9)[None, :]
    outside = (k > q) | (q - k >= window)
    for i in local:
        assert torch.isneginf(cache[f"blocks.{i}.attn.hook_attn_scores"][..., outside]).all()
        assert (cache[f"blocks.{i}.attn.hook_pattern"][..., outside] == 0).all()
    glob = next(i for i, kind in enumerate(reference.config.attention_layers) if kind == "global")
    assert (cache[f"blocks.{glob}.attn.hook_pattern"][..., (k <= q) & outside] > 0).all()


def test_falcon_mlp_out_is_not_overwritten_by_the_in_place_add(
    bridge_of: Callable[[str], TransformerBridge],
) -> None:
    bridge = bridge_of("falcon")
    ids = torch.tensor([[1, 8, 30, 99, 4]])
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    for i in range(bridge.cfg.n_layers):
        b = f"blocks.{i}."
        total = cache[b + "hook_in"] + cache[b + "attn.hook_out"] + cache[b + "mlp.hook_out"]
        torch.testing.assert_close(cache[b + "hook_out"], total, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache[b + "mlp.hook_in"], cache[b + "ln1.hook_out"])
    assert "one norm per block" in bridge.driver.non_fireable_reasons["blocks.0.ln2.hook_out"]


def test_bloom_sublayer_hooks_are_contributions(
    bridge_of: Callable[[str], TransformerBridge],
) -> None:
    bridge = bridge_of("bloom")
    ids = torch.tensor([[1, 8, 30, 99, 4]])
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    for i in range(bridge.cfg.n_layers):
        b = f"blocks.{i}."
        torch.testing.assert_close(
            cache[b + "ln2.hook_in"], cache[b + "hook_in"] + cache[b + "attn.hook_out"]
        )
        torch.testing.assert_close(
            cache[b + "hook_out"], cache[b + "ln2.hook_in"] + cache[b + "mlp.hook_out"]
        )
    # embed.hook_out is the raw lookup; the embedding LayerNorm sits before blocks.0.hook_in.
    norm = bridge.driver.hf_model.transformer.word_embeddings_layernorm
    torch.testing.assert_close(cache["blocks.0.hook_in"], norm(cache["embed.hook_out"]))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"new_decoder_architecture": True}, "new_decoder_architecture"),
        ({"alibi": True}, "alibi"),
    ],
)
def test_falcon_layouts_the_driver_does_not_serve_are_refused(
    overrides: dict[str, object], match: str, checkpoint: Callable[[str], Path]
) -> None:
    with pytest.raises(ConfigError, match=match):
        TransformerBridge.boot_transformers(
            str(checkpoint("falcon")), hf_config_overrides=overrides
        )
