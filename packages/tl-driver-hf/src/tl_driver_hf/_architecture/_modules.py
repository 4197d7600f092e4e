"""Resolve an adapter's dotted paths to the modules of one loaded transformers model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tl_core import ConfigError
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["LayerModules", "ModelModules", "has_attention_sinks", "resolve_modules"]


@dataclass(frozen=True)
class LayerModules:
    """The modules of one decoder layer (``None`` where the family has no such part)."""

    layer: nn.Module
    ln1: nn.Module | None
    ln2: nn.Module | None
    ln1_post: nn.Module | None
    ln2_post: nn.Module | None
    attn: nn.Module
    #: The module that calls the attention function (``attn`` unless the adapter names an
    #: ``attention_core`` inside it).
    attn_core: nn.Module
    q: nn.Module | None
    k: nn.Module | None
    v: nn.Module | None
    qkv: nn.Module | None
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    o: nn.Module
    mlp: nn.Module
    mlp_in: nn.Module | None
    gate: nn.Module | None
    up: nn.Module | None
    gate_up: nn.Module | None
    down: nn.Module | None
    router: nn.Module | None
    experts: nn.Module | None = None
    shared_expert: nn.Module | None = None
    shared_gate: nn.Module | None = None
    shared_up: nn.Module | None = None
    shared_down: nn.Module | None = None
    shared_expert_gate: nn.Module | None = None
    q_latent: nn.Module | None = None
    q_up: nn.Module | None = None
    kv_latent: nn.Module | None = None
    kv_up: nn.Module | None = None
    mixer: nn.Module | None = None


@dataclass(frozen=True)
class ModelModules:
    """The model-level modules and every layer's modules."""

    embed: nn.Module
    embed_norm: nn.Module | None
    pos_embed: nn.Module | None
    token_type_embed: nn.Module | None
    layers: tuple[LayerModules, ...]
    final_norm: nn.Module | None
    lm_head: nn.Module
    head_dense: nn.Module | None = None
    head_act: nn.Module | None = None


def has_attention_sinks(modules: ModelModules) -> bool:
    """Whether attention adds a learned sink logit per head (gpt-oss's ``sinks``)."""
    return bool(modules.layers) and isinstance(
        getattr(modules.layers[0].attn, "sinks", None), torch.Tensor
    )


def _get(
    root: nn.Module, path: str | None, where: str, adapter: ArchitectureAdapter
) -> nn.Module | None:
    if path is None:
        return None
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise ConfigError(
            f"the {adapter.family!r} adapter expects a module at {where}{path!r} in "
            f"{type(root).__name__}, which has none; this transformers version may have renamed "
            f"it (tl-driver-hf is tested with transformers 5.x)"
        ) from None


def _need(root: nn.Module, path: str, where: str, adapter: ArchitectureAdapter) -> nn.Module:
    module = _get(root, path, where, adapter)
    assert module is not None
    return module


def _shared_expert(
    mlp: nn.Module, adapter: ArchitectureAdapter, where: str
) -> dict[str, nn.Module | None]:
    shared = _get(mlp, adapter.shared_expert, where, adapter)
    if shared is None or adapter.shared_parts is None:
        return {}
    inner = f"{where}{adapter.shared_expert}."
    gate, up, down = (_need(shared, part, inner, adapter) for part in adapter.shared_parts)
    return {"shared_expert": shared, "shared_gate": gate, "shared_up": up, "shared_down": down}


def resolve_modules(model: nn.Module, adapter: ArchitectureAdapter) -> ModelModules:
    """Find every module ``adapter`` names inside ``model``.

    Raises:
        ConfigError: A path that does not exist (names the family and the path).
    """
    layers_module = _need(model, adapter.layers, "", adapter)
    layers: list[LayerModules] = []
    layer: nn.Module
    for index, layer in enumerate(layers_module):  # type: ignore[arg-type]
        where = f"{adapter.layers}.{index}."
        attn = _need(layer, adapter.attn, where, adapter)
        mlp = _need(layer, adapter.mlp, where, adapter)
        attn_where = f"{where}{adapter.attn}."
        mlp_where = f"{where}{adapter.mlp}."
        layers.append(
            LayerModules(
                layer=layer,
                ln1=_get(layer, adapter.ln1, where, adapter),
                ln2=_get(layer, adapter.ln2, where, adapter),
                ln1_post=_get(layer, adapter.ln1_post, where, adapter),
                ln2_post=_get(layer, adapter.ln2_post, where, adapter),
                attn=attn,
                attn_core=_get(attn, adapter.attention_core, attn_where, adapter) or attn,
                q=_get(attn, adapter.q, attn_where, adapter),
                k=_get(attn, adapter.k, attn_where, adapter),
                v=_get(attn, adapter.v, attn_where, adapter),
                qkv=_get(attn, adapter.qkv, attn_where, adapter),
                q_norm=_get(attn, adapter.q_norm, attn_where, adapter),
                k_norm=_get(attn, adapter.k_norm, attn_where, adapter),
                q_latent=_get(attn, adapter.q_latent, attn_where, adapter),
                q_up=_get(attn, adapter.q_up, attn_where, adapter),
                kv_latent=_get(attn, adapter.kv_latent, attn_where, adapter),
                kv_up=_get(attn, adapter.kv_up, attn_where, adapter),
                mixer=_get(layer, adapter.mixer, where, adapter),
                o=_need(attn, adapter.o, attn_where, adapter),
                mlp=mlp,
                mlp_in=_get(mlp, adapter.mlp_in, mlp_where, adapter),
                gate=_get(mlp, adapter.gate, mlp_where, adapter),
                up=_get(mlp, adapter.up, mlp_where, adapter),
                gate_up=_get(mlp, adapter.gate_up, mlp_where, adapter),
                down=_get(mlp, adapter.down, mlp_where, adapter),
                router=_get(mlp, adapter.router, mlp_where, adapter),
                experts=_get(mlp, adapter.experts, mlp_where, adapter),
                shared_expert_gate=_get(mlp, adapter.shared_expert_gate, mlp_where, adapter),
                **_shared_expert(mlp, adapter, mlp_where),
            )
        )
    return ModelModules(
        embed=_need(model, adapter.embed, "", adapter),
        embed_norm=_get(model, adapter.embed_norm, "", adapter),
        pos_embed=_get(model, adapter.pos_embed, "", adapter),
        token_type_embed=_get(model, adapter.token_type_embed, "", adapter),
        layers=tuple(layers),
        final_norm=_get(model, adapter.final_norm, "", adapter),
        lm_head=_need(model, adapter.lm_head, "", adapter),
        head_dense=_get(model, adapter.head_dense, "", adapter),
        head_act=_get(model, adapter.head_act, "", adapter),
    )
