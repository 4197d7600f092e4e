"""Multi-head latent attention (DeepSeek-V2/V3): the compressed latents as certified sites.

References are plain torch hooks on transformers' own latent norms (``q_a_layernorm``,
``kv_a_layernorm``), found by name here, independently of the driver's inference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from transformers import DeepseekV2Config, DeepseekV3Config, PreTrainedModel

from tl_driver_hf import build_bridge_from_module
from tl_driver_hf._architecture._describe import shrunk_model
from tl_driver_hf.adapters import _EXTRA, register_adapter

_SIZES: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, head_dim=8,
)  # fmt: skip


def _deepseek(version: int, q_lora_rank: int | None) -> PreTrainedModel:
    cls = DeepseekV3Config if version == 3 else DeepseekV2Config
    config = cls(q_lora_rank=q_lora_rank, **_SIZES)
    config.architectures = [f"DeepseekV{version}ForCausalLM"]
    return shrunk_model(config, sizes={})


def _ids() -> torch.Tensor:
    return torch.randint(1, 500, (2, 7), generator=torch.Generator().manual_seed(3))


def _attention(model: nn.Module, i: int) -> nn.Module:
    return model.model.layers[i].self_attn  # type: ignore[no-any-return]


@pytest.mark.parametrize(("version", "q_lora_rank"), [(3, 24), (2, None)])
def test_latents_are_served_as_plain_hooks_see_them(version: int, q_lora_rank: int | None) -> None:
    model = _deepseek(version, q_lora_rank)
    bridge = build_bridge_from_module(model)
    names = ["blocks.1.attn.hook_kv_latent"] + (
        ["blocks.1.attn.hook_q_latent"] if q_lora_rank else []
    )
    assert set(names) <= set(bridge.driver.hook_points)
    if q_lora_rank is None:
        # DeepSeek-V2-Lite's layout: queries are not compressed, so there is no query latent.
        assert (
            "does not compress queries"
            in bridge.namespace.non_fireable_reasons["blocks.1.attn.hook_q_latent"]
        )
        assert (
            "blocks.1.attn.hook_q_latent" not in bridge.driver.hook_points
            and bridge.cfg.d_q_latent is None
        )
    assert bridge.architecture is not None and bridge.architecture.attention is not None
    assert bridge.architecture.attention.variant == "mla"
    assert (
        bridge.architecture.attention.d_q_latent,
        bridge.architecture.attention.d_kv_latent,
    ) == (q_lora_rank, 16)
    seen: dict[str, torch.Tensor] = {}
    attn = _attention(model, 1)
    handles = [
        attn.kv_a_layernorm.register_forward_hook(
            lambda m, a, out: seen.setdefault("kv", out.detach().clone())
        )
    ]
    if q_lora_rank:
        handles.append(
            attn.q_a_layernorm.register_forward_hook(
                lambda m, a, out: seen.setdefault("q", out.detach().clone())
            )
        )
    try:
        with torch.no_grad():
            model(input_ids=_ids(), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    _, cache = bridge.run_with_cache(_ids(), names_filter=names)
    torch.testing.assert_close(cache["blocks.1.attn.hook_kv_latent"], seen["kv"], rtol=0, atol=0)
    assert cache["blocks.1.attn.hook_kv_latent"].shape[-1] == bridge.cfg.d_kv_latent == 16
    if q_lora_rank:
        torch.testing.assert_close(cache["blocks.1.attn.hook_q_latent"], seen["q"], rtol=0, atol=0)


def test_an_edit_of_a_latent_is_a_plain_forward_hook_on_its_norm() -> None:
    model = _deepseek(3, 24)
    bridge = build_bridge_from_module(model)
    delta = torch.randn(16, generator=torch.Generator().manual_seed(5))
    handle = _attention(model, 0).kv_a_layernorm.register_forward_hook(
        lambda m, a, out: out + delta
    )
    try:
        with torch.no_grad():
            want = model(input_ids=_ids(), use_cache=False).logits
    finally:
        handle.remove()
    spec = {"blocks.0.attn.hook_kv_latent": {"op": "add", "value": delta.tolist()}}
    got = bridge.forward(_ids(), intervene=spec)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, bridge.forward(_ids()), atol=1e-3)  # the edit moved the logits


@pytest.fixture
def swapped_latents() -> Iterator[Callable[[PreTrainedModel], None]]:
    """Registers, for this test only, a DeepSeek-V3 description whose two latents are
    swapped (both of width 16, so nothing but the equations can tell)."""
    added: list[Any] = []

    def register(model: PreTrainedModel) -> None:
        adapter = build_bridge_from_module(model).driver.adapter
        description = dataclasses.replace(
            adapter.description, family="deepseek-swapped", model_types=("deepseek_v3",),
            architectures=("DeepseekV3ForCausalLM",), inferred=False,
        )  # fmt: skip
        wrong = dataclasses.replace(
            adapter, description=description, q_latent=adapter.kv_latent,
            kv_latent=adapter.q_latent, verified=True,
        )  # fmt: skip
        register_adapter(wrong)
        added.append(wrong)

    yield register
    for adapter in added:
        _EXTRA.remove(adapter)


def test_swapped_latents_fail_their_equations_and_are_not_served(
    swapped_latents: Callable[[PreTrainedModel], None],
) -> None:
    model = _deepseek(3, 16)  # a query latent as wide as the key/value one
    swapped_latents(model)
    bridge = build_bridge_from_module(model)
    assert bridge.driver.adapter.family == "deepseek-swapped"
    report = bridge.driver.certify()
    for name in ("blocks.0.attn.hook_kv_latent", "blocks.0.attn.hook_q_latent"):
        assert name not in bridge.driver.hook_points
        status = report.statuses[name]
        assert status.status == "uncertified" and "expanded by" in status.reason, status
