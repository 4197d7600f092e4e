"""Offline support checks, listings, tokenizer detection, and weights in HookedTransformer shapes."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, BertConfig

from tl_core import TransformerBridge, UserError
from tl_driver_hf import (
    build_bridge_config_from_hf,
    check_model_support,
    detect_tokenizer_bos_eos,
    list_supported_models,
)
from tl_driver_hf.testing import train_tiny_tokenizer


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the network was used")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_check_model_support_answers_offline(
    no_network: None, checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = check_model_support(str(checkpoint("gemma2")))
    assert (
        folder.supported
        and folder.family == "gemma2"
        and folder.architecture == "Gemma2ForCausalLM"
    )
    assert "config.json" in folder.reason
    config = check_model_support(AutoConfig.from_pretrained(checkpoint("phi3")))
    assert config and config.family == "phi3"
    assert check_model_support("MixtralForCausalLM").family == "mixtral"
    assert check_model_support("qwen3").family == "qwen3"
    hub = check_model_support("meta-llama/Llama-3.2-1B")
    assert hub.supported and hub.family == "llama" and "pattern" in hub.reason and hub.verified
    assert check_model_support("openai-community/gpt2").family == "gpt2"
    crfm = check_model_support("stanford-crfm/alias-gpt2-small-x21")
    assert crfm.supported and crfm.checkpointed
    bert = check_model_support("google-bert/bert-base-uncased")
    assert (
        not bert
        and "described families" in bert.reason
        and "infers its architecture" in bert.reason
    )
    BertConfig().save_pretrained(tmp_path)
    local_bert = check_model_support(str(tmp_path))
    assert not local_bert.supported and local_bert.model_type == "bert"
    with pytest.raises(UserError):
        check_model_support(3)
    # A mistyped path is reported as one, not judged as a hub id by its name.
    missing = check_model_support(str(tmp_path / "missing"))
    assert (
        not missing
        and "is a path, but folder" in missing.reason
        and "does not exist" in missing.reason
    )
    config_file = check_model_support(str(tmp_path / "config.json"))
    assert (
        not config_file
        and f"pass the folder that holds it, {str(tmp_path)!r}" in config_file.reason
    )


def test_list_supported_models() -> None:
    every = list_supported_models()
    assert "meta-llama/Llama-3.2-1B" in every and "openai-community/gpt2" in every
    assert every == sorted(every)
    assert set(list_supported_models("gemma2")) == {
        m for m in every if m.startswith("google/gemma-2-")
    }
    assert list_supported_models("Qwen3ForCausalLM") == list_supported_models("qwen3")
    assert set(list_supported_models(verified_only=True)) <= set(every)
    with pytest.raises(UserError, match="no adapter serves"):
        list_supported_models("bert")


def test_build_bridge_config_from_hf(checkpoint: Callable[[str], Path]) -> None:
    info = build_bridge_config_from_hf(AutoConfig.from_pretrained(checkpoint("gemma2")))
    assert (info.n_layers, info.d_model, info.n_heads, info.d_head, info.n_key_value_heads) == (
        2,
        128,
        4,
        32,
        2,
    )
    assert info.sandwich_norm and info.gated_mlp and info.positional_embedding_type == "rotary"
    gpt2 = build_bridge_config_from_hf(AutoConfig.from_pretrained(checkpoint("gpt2")))
    assert gpt2.normalization_type == "LN" and gpt2.positional_embedding_type == "standard"
    assert gpt2.d_mlp == 256 and gpt2.n_ctx == 256


class _NoIds:
    """A tokenizer that only reveals its specials by adding them."""

    bos_token_id = None
    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [7, 42, 9] if add_special_tokens else [42]


def test_detect_tokenizer_bos_eos() -> None:
    assert detect_tokenizer_bos_eos(train_tiny_tokenizer()) == (1, 2)
    assert detect_tokenizer_bos_eos(_NoIds()) == (7, 9)


def test_weights_reproduce_the_hooks(
    bridge: TransformerBridge, family: str, ids: torch.Tensor
) -> None:
    info = bridge.cfg
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    assert bridge.W_Q.shape == (info.n_layers, info.n_heads, info.d_model, info.d_head)
    assert (
        bridge.W_K.shape
        == bridge.W_V.shape
        == (info.n_layers, info.kv_heads, info.d_model, info.d_head)
    )
    assert bridge.W_O.shape == (info.n_layers, info.n_heads, info.d_head, info.d_model)
    assert bridge.b_O.shape == (info.n_layers, info.d_model)
    assert bridge.W_U.shape == (info.d_model, info.d_vocab) and bridge.b_U.shape == (info.d_vocab,)
    torch.testing.assert_close(cache["embed.hook_out"], bridge.W_E[ids])
    if info.positional_embedding_type == "standard":
        torch.testing.assert_close(cache["pos_embed.hook_out"][0], bridge.W_pos[: ids.shape[1]])
        torch.testing.assert_close(
            cache["embed.hook_out"] + cache["pos_embed.hook_out"], cache["blocks.0.hook_in"]
        )
    elif family != "bloom":  # BLOOM normalises the embedding before block 0
        # The embedding as it enters the residual stream (Gemma's sqrt(d_model) scale included).
        torch.testing.assert_close(cache["embed.hook_out"], cache["blocks.0.hook_in"])
    for layer in range(info.n_layers):
        b = f"blocks.{layer}."
        x = cache[b + "attn.hook_in"]
        # hook_q/k/v are the projections' outputs (before any QK-norm and rotary).
        for key, weight, bias in (
            ("q", bridge.W_Q, bridge.b_Q),
            ("k", bridge.W_K, bridge.b_K),
            ("v", bridge.W_V, bridge.b_V),
        ):
            expected = torch.einsum("bpd,hde->bphe", x, weight[layer]) + bias[layer]
            torch.testing.assert_close(cache[f"{b}attn.hook_{key}"], expected, atol=1e-5, rtol=1e-5)
        out = (
            torch.einsum("bphe,hed->bpd", cache[b + "attn.hook_z"], bridge.W_O[layer])
            + bridge.b_O[layer]
        )
        torch.testing.assert_close(cache[b + "attn.hook_out"], out, atol=1e-5, rtol=1e-5)
        if bridge.driver.adapter.description.moe:
            with pytest.raises(UserError, match="mixture of experts"):
                _ = bridge.W_in
            continue
        m = cache[b + "mlp.hook_in"]
        first = bridge.W_gate if info.gated_mlp else bridge.W_in
        bias = 0 if info.gated_mlp else bridge.b_in[layer]
        torch.testing.assert_close(
            cache[b + "mlp.hook_pre"], m @ first[layer] + bias, atol=1e-5, rtol=1e-5
        )
        if info.gated_mlp:
            torch.testing.assert_close(
                cache[b + "mlp.hook_pre_linear"],
                m @ bridge.W_in[layer] + bridge.b_in[layer],
                atol=1e-5,
                rtol=1e-5,
            )
        mlp_out = cache[b + "mlp.hook_post"] @ bridge.W_out[layer] + bridge.b_out[layer]
        torch.testing.assert_close(cache[b + "mlp.hook_out"], mlp_out, atol=1e-5, rtol=1e-5)
    logits = cache["ln_final.hook_out"] @ bridge.W_U + bridge.b_U
    torch.testing.assert_close(cache["unembed.hook_out"], logits, atol=1e-5, rtol=1e-5)


def test_readout_turns_the_final_residual_into_logits(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    readout = bridge.driver.readout()
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids, names_filter=["ln_final.hook_in"])
    x = cache["ln_final.hook_in"]
    if readout.normalization_type == "LN":
        x = x - x.mean(-1, keepdim=True)
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + readout.eps)
    if readout.ln_final_weight is not None:
        x = x * readout.ln_final_weight
    if readout.ln_final_bias is not None:
        x = x + readout.ln_final_bias
    out = x @ readout.W_U + (readout.b_U if readout.b_U is not None else 0)
    if readout.logit_softcap is not None:
        out = torch.tanh(out / readout.logit_softcap) * readout.logit_softcap
    torch.testing.assert_close(out, logits, atol=1e-4, rtol=1e-4)
