"""Per-position feature shapes of canonical hooks, from their layout and the model's sizes."""

from __future__ import annotations

from tl_core.hooks._model_info import ModelInfo

__all__ = ["feature_shape", "position_axis"]

_KV_HOOKS = (
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_rot_k",
    "attn.hook_k_input",
    "attn.hook_v_input",
)
_KV_NORM = ".attn.k_norm."


def feature_shape(name: str, layout: str, info: ModelInfo) -> tuple[int, ...] | None:
    """The shape after the ``batch, pos`` axes of canonical hook ``name``.

    Returns ``None`` for attention scores and patterns, whose width is the key length.
    """
    if layout == "b h q k":
        return None
    kv = name.endswith(_KV_HOOKS) or _KV_NORM in name
    heads = info.kv_heads if kv else info.n_heads
    shapes: dict[str, tuple[int, ...]] = {
        "b p": (),
        "b p d": (info.d_model,),
        "b p 1": (1,),
        "b p h dh": (heads, info.d_head),
        "b p h 1": (heads, 1),
        "b p r": (info.rotary_width,),
        "b p dm": (info.d_mlp,),
        "b p ds": (info.d_shared_expert or 0,),
        "b p lq": (info.d_q_latent or 0,),
        "b p lkv": (info.d_kv_latent or 0,),
        "b p vocab": (info.d_vocab,),
        "b p h d": (heads, info.d_model),
        "b p e": (info.n_experts or 0,),
        "b p k": (info.experts_per_token or 0,),
    }
    if layout not in shapes:
        raise ValueError(f"unknown hook layout {layout!r} for {name!r}")
    return shapes[layout]


def position_axis(layout: str) -> int:
    """Which axis of a hook's tensor indexes the (query) position."""
    return 2 if layout == "b h q k" else 1
