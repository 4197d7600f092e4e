"""run_with_cache, names filters, ragged batches and the canonical shapes on native models."""

from __future__ import annotations

import pytest
import torch

from tl_core import HookNameError, TransformerBridge, canonical_hook_names, layout_of

PROMPTS = ["The quick brown fox", "Hi", "A longer prompt than the others, padded"]


def _expected_shape(
    layout: str, bridge: TransformerBridge, name: str, b: int, p: int
) -> tuple[int, ...]:
    cfg = bridge.cfg
    heads = cfg.kv_heads if name.endswith(("hook_k", "hook_v", "hook_rot_k")) else cfg.n_heads
    sizes = {
        "b": b,
        "p": p,
        "q": p,
        "k": p,
        "d": cfg.d_model,
        "1": 1,
        "h": heads,
        "dh": cfg.d_head,
        "dm": cfg.d_mlp,
        "vocab": cfg.d_vocab,
        "r": cfg.rotary_width,
    }
    if layout == "b h q k":
        sizes["h"] = cfg.n_heads
    return tuple(sizes[a] for a in layout.split())


def test_every_canonical_hook_fires_with_its_design_shape(bridge: TransformerBridge) -> None:
    _, cache = bridge.run_with_cache("Hello world")
    expected = set(canonical_hook_names(bridge.cfg, include_attn_result=True))
    assert set(cache) == expected == set(bridge.hook_dict)
    p = len(bridge.to_tokens("Hello world")[0])
    for name, tensor in cache.items():
        assert tuple(tensor.shape) == _expected_shape(layout_of(name), bridge, name, 1, p), name


def test_capture_equals_logits_and_residual_identities(bridge: TransformerBridge) -> None:
    logits, cache = bridge.run_with_cache("Residual identities hold")
    torch.testing.assert_close(cache["unembed.hook_out"], logits)
    for i in range(bridge.cfg.n_layers):
        resid = (
            cache[f"blocks.{i}.hook_in"]
            + cache[f"blocks.{i}.attn.hook_out"]
            + cache[f"blocks.{i}.mlp.hook_out"]
        )
        torch.testing.assert_close(cache[f"blocks.{i}.hook_out"], resid, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            cache[f"blocks.{i}.attn.hook_result"].sum(2),
            cache[f"blocks.{i}.attn.hook_out"] - bridge.b_O[i],
            atol=1e-5,
            rtol=1e-5,
        )


def test_names_filter_spellings_select_the_same_hooks(bridge: TransformerBridge) -> None:
    _, by_alias = bridge.run_with_cache(
        "x y", names_filter=["blocks.1.hook_resid_post", "hook_embed"]
    )
    _, by_pred = bridge.run_with_cache(
        "x y", names_filter=lambda n: n in ("blocks.1.hook_out", "embed.hook_out")
    )
    _, by_str = bridge.run_with_cache("x y", names_filter="blocks.1.hook_out")
    assert set(by_alias) == set(by_pred) == {"blocks.1.hook_out", "embed.hook_out"}
    assert set(by_str) == {"blocks.1.hook_out"}
    torch.testing.assert_close(by_alias["blocks.1.hook_resid_post"], by_pred["blocks.1.hook_out"])


def test_ragged_batch_matches_single_prompts(bridge: TransformerBridge) -> None:
    logits, cache = bridge.run_with_cache(PROMPTS)
    assert cache.lengths == tuple(len(bridge.to_tokens(p)[0]) for p in PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        single_logits, single = bridge.run_with_cache(prompt)
        n = cache.lengths[i]
        torch.testing.assert_close(logits[i, :n], single_logits[0], atol=1e-5, rtol=1e-5)
        trimmed = cache.prompt(i)
        for name in ("blocks.2.hook_out", "blocks.0.attn.hook_pattern", "ln_final.hook_normalized"):
            torch.testing.assert_close(trimmed[name], single[name], atol=1e-5, rtol=1e-5)


def test_device_and_remove_batch_dim(bridge: TransformerBridge) -> None:
    _, cache = bridge.run_with_cache(
        "abc", device="cpu", remove_batch_dim=True, names_filter="blocks.0.hook_out"
    )
    assert cache["blocks.0.hook_out"].shape == (4, bridge.cfg.d_model)


def test_unknown_and_absent_hooks_are_clear_errors() -> None:
    llama = TransformerBridge.boot_native("llama", n_layers=2)
    with pytest.raises(HookNameError, match=r"blocks\.1\.hook_resid_post|blocks\.1\.hook_out"):
        llama.run_with_cache("x", names_filter=["blocks.1.hook_resid_psot"])
    with pytest.raises(HookNameError, match=r"pos_embed.hook_out.*not learned embeddings"):
        llama.run_with_cache("x", names_filter=["hook_pos_embed"])
    with pytest.raises(HookNameError, match=r"blocks.7.hook_out.*2 blocks"):
        llama.run_with_cache("x", names_filter=["blocks.7.hook_out"])
    with pytest.raises(HookNameError, match="use_attn_result=True"):
        llama.run_with_cache("x", names_filter=["blocks.0.attn.hook_result"])


def test_stop_and_start_at_layer_round_trip(bridge: TransformerBridge) -> None:
    tokens = bridge.to_tokens("Round trip through the middle")
    resid = bridge(tokens, stop_at_layer=2)
    _, cache = bridge.run_with_cache(tokens, names_filter="blocks.2.hook_in")
    torch.testing.assert_close(resid, cache["blocks.2.hook_in"])
    torch.testing.assert_close(
        bridge(tokens), bridge(tokens, start_at_layer=2, residual=resid), atol=1e-5, rtol=1e-5
    )
    _, partial = bridge.run_with_cache(tokens, stop_at_layer=1)
    assert "blocks.0.hook_out" in partial and "blocks.1.hook_out" not in partial
