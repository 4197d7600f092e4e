"""Hooked re-implementations of attention modules that never call ``AttentionInterface``.

GPT-Neo, BLOOM, and Falcon and GPT-J in earlier 5.x releases, compute attention inside the module's own
``forward`` instead of calling the function ``config._attn_implementation`` names, so the
driver's hooked attention function never sees their q/k/v, scores or pattern. For these
families the driver replaces each attention module's ``forward`` for the duration of a run
(an instance attribute, removed afterwards; under accelerate's offload hooks the wrapped
``_old_forward`` is replaced instead, so weights are still brought in) with a function here
that performs the same operations in the same order and fires the canonical hooks:

* ``gpt_neo``: q/k/v without bias, scores ``q k^T`` in float32 with **no** ``1/sqrt(dh)``
  scaling, the layer's causal (global) or sliding-window (local) mask, softmax in float32.
* ``bloom``: fused ``query_key_value`` split per head (``[h, 3, dh]``); scores are
  ``alibi + q k^T / sqrt(dh)`` (the ALiBi bias is part of ``hook_attn_scores``, as in
  HookedTransformer); softmax in float32; the module adds the residual to its output.
* ``falcon_legacy``: Falcon (Falcon-7B layout) as transformers up to 5.24 writes it (its
  attention has ``_split_heads``): one shared key/value head, rotary on the whole head,
  scores ``q k^T / sqrt(dh)``, softmax in the activations' dtype. 5.25 calls
  ``AttentionInterface`` (with ``alibi`` no longer an argument) and needs nothing here.
* ``gptj_legacy``: GPT-J as transformers up to 5.19 writes it (``GPTJAttention._attn``,
  the rotary table a buffer of the module), which adds the attention mask to the scores
  and so would read the driver's boolean (or absent) mask as no mask at all. Rotary
  "every two" on the first ``rotary_dim`` features, scores ``q k^T / sqrt(dh)`` and the
  softmax in float32. Later versions call ``AttentionInterface`` and need nothing here;
  ``LEGACY_FORWARDS`` picks this one only where the module still has ``_attn``.

While the driver runs a forward the config names ``tl_hooked``, whose mask builder gives
boolean masks (``True`` = may attend) or ``None`` (plain causal); a query row with no
visible key (left padding) gets an all-zero pattern, as on every other family.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tl_core import ConfigError, UserError
from tl_driver_hf._runtime._attention import AttentionSite, _allowed, _fire_bhpd
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["INLINE_FORWARDS", "LEGACY_FORWARDS", "inline_attention"]

_MISSING = object()


def _fire(point: Any, x: torch.Tensor) -> torch.Tensor:
    """Fire a hook whose layout is the tensor's own (scores, pattern)."""
    if point is None or not point.has_hooks:
        return x
    return point(x)  # type: ignore[no-any-return]


def _masked_scores(
    scores: torch.Tensor, allowed: torch.Tensor, site: AttentionSite
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask with ``-inf`` and fire ``hook_attn_scores``; returns ``(scores, row_valid)``."""
    scores = _fire(site.scores, scores.masked_fill(~allowed, float("-inf")))
    return scores, allowed.any(dim=-1, keepdim=True)


def _pattern(
    scores: torch.Tensor,
    row_valid: torch.Tensor,
    site: AttentionSite,
    *,
    compute: torch.dtype | None,
    out: torch.dtype,
) -> torch.Tensor:
    """Softmax (in ``compute`` dtype, or the scores' own) with empty rows zeroed; fires the hook."""
    if bool(row_valid.all()):
        pattern = F.softmax(scores, dim=-1, dtype=compute).to(out)
    else:
        # A row of only -inf softmaxes to NaN, and NaN * 0 would still reach real tokens.
        pattern = F.softmax(scores.masked_fill(~row_valid, 0.0), dim=-1, dtype=compute).to(out)
        pattern = pattern.masked_fill(~row_valid, 0.0)
    return _fire(site.pattern, pattern)


def _z_to_output(z: torch.Tensor, site: AttentionSite, dense: nn.Module) -> torch.Tensor:
    """``z [b, h, q, dh]`` -> fire ``hook_z`` (``b q h dh``) -> output projection."""
    z = z.transpose(1, 2).contiguous()
    if site.z.has_hooks:
        z = site.z(z)
    return cast(torch.Tensor, dense(z.flatten(-2)))


def _gpt_neo(
    module: Any,
    site: AttentionSite,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``GPTNeoSelfAttention.forward`` with hooks (no score scaling, float32 scores)."""
    heads, d_head = int(module.num_heads), int(module.head_dim)

    def split(x: torch.Tensor) -> torch.Tensor:
        return torch.unflatten(x, -1, (heads, d_head)).transpose(1, 2)

    query = _fire_bhpd(site.q, split(module.q_proj(hidden_states)))
    key = _fire_bhpd(site.k, split(module.k_proj(hidden_states)))
    value = _fire_bhpd(site.v, split(module.v_proj(hidden_states)))
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_id)
    scores = torch.matmul(query.to(torch.float32), key.to(torch.float32).transpose(-1, -2))
    q_len, k_len = query.shape[-2], key.shape[-2]
    # The module's own causal (or sliding-window, on local layers) table, and the padding.
    window = cast(torch.Tensor, module.bias)[:, :, k_len - q_len : k_len, :k_len]
    allowed = window & _allowed(attention_mask, q_len, k_len, scores.device)
    scores, row_valid = _masked_scores(scores, allowed, site)
    pattern = _pattern(scores, row_valid, site, compute=None, out=value.dtype)
    z = torch.matmul(module.attn_dropout(pattern), value)
    out = module.resid_dropout(_z_to_output(z, site, module.out_proj))
    return out, pattern


def _bloom(
    module: Any,
    site: AttentionSite,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    alibi: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``BloomAttention.forward`` with hooks (ALiBi in the scores, residual added at the end)."""
    if module.pretraining_tp > 1 and module.slow_but_exact:
        raise UserError(
            "this BLOOM config sets slow_but_exact=True with pretraining_tp > 1 (an emulation "
            "of tensor-parallel rounding that skips the output projection's bias); the hf "
            "driver does not reproduce it. Load it with hf_config_overrides={'slow_but_exact': False}."
        )
    batch, q_len, _ = hidden_states.shape
    heads, d_head = int(module.num_heads), int(module.head_dim)
    fused = torch.unflatten(module.query_key_value(hidden_states), -1, (heads, 3, d_head))
    query = _fire_bhpd(site.q, fused[..., 0, :].transpose(1, 2))
    key = _fire_bhpd(site.k, fused[..., 1, :].transpose(1, 2))
    value = _fire_bhpd(site.v, fused[..., 2, :].transpose(1, 2))
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    k_len = key.shape[-2]
    scores = alibi.baddbmm(
        batch1=query.reshape(batch * heads, q_len, d_head),
        batch2=key.reshape(batch * heads, k_len, d_head).transpose(-1, -2),
        beta=module.beta,
        alpha=module.inv_norm_factor,
    ).view(batch, heads, q_len, k_len)
    allowed = _allowed(attention_mask, q_len, k_len, scores.device)
    scores, row_valid = _masked_scores(scores, allowed, site)
    pattern = _pattern(scores, row_valid, site, compute=torch.float32, out=query.dtype)
    z = torch.matmul(module.attention_dropout(pattern), value)
    out = _z_to_output(z, site, module.dense)
    out = F.dropout(out, p=module.hidden_dropout, training=module.training) + residual
    return out, pattern


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _falcon_legacy(
    module: Any,
    site: AttentionSite,
    hidden_states: torch.Tensor,
    alibi: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FalconAttention.forward`` before 5.25 (multi-query, rotary, old decoder layout) with hooks."""
    if alibi is not None or module.new_decoder_architecture or not module.multi_query:
        raise UserError(
            "the hf driver serves Falcon's multi-query rotary layout only (Falcon-7B: "
            "multi_query=True, alibi=False, new_decoder_architecture=False)"
        )
    assert position_embeddings is not None
    q_len = hidden_states.shape[1]
    heads, d_head = int(module.num_heads), int(module.head_dim)
    # [q heads | one key head | one value head] per position.
    fused = torch.unflatten(module.query_key_value(hidden_states), -1, (heads + 2, d_head))
    query = fused[..., :-2, :].transpose(1, 2)
    key = fused[..., -2:-1, :].transpose(1, 2)
    value = fused[..., -1:, :].transpose(1, 2)
    cos, sin = (t.unsqueeze(1) for t in position_embeddings)
    query = _fire_bhpd(site.q, query * cos + _rotate_half(query) * sin)
    key = _fire_bhpd(site.k, key * cos + _rotate_half(key) * sin)
    value = _fire_bhpd(site.v, value)
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    scores = (query @ key.transpose(-1, -2)) / math.sqrt(d_head)
    allowed = _allowed(attention_mask, q_len, key.shape[-2], scores.device)
    scores, row_valid = _masked_scores(scores, allowed, site)
    pattern = _pattern(
        scores, row_valid, site, compute=hidden_states.dtype, out=hidden_states.dtype
    )
    out = _z_to_output(pattern @ value, site, module.dense)
    return out, pattern


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1)
    return pairs.flatten(-2)


def _gptj_legacy(
    module: Any,
    site: AttentionSite,
    hidden_states: torch.Tensor,
    layer_past: Any = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    use_cache: bool | None = False,
    output_attentions: bool | None = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``GPTJAttention.forward`` of transformers <= 5.19 with hooks (partial rotary, fp32 scores)."""
    assert position_ids is not None
    q_len = hidden_states.shape[1]
    heads, d_head = int(module.num_attention_heads), int(module.head_dim)
    query = torch.unflatten(module.q_proj(hidden_states), -1, (heads, d_head))
    key = torch.unflatten(module.k_proj(hidden_states), -1, (heads, d_head))
    value = torch.unflatten(module.v_proj(hidden_states), -1, (heads, d_head)).transpose(1, 2)
    table = cast(torch.Tensor, module.embed_positions).to(position_ids.device)[position_ids]
    sin, cos = (
        t.to(key.dtype).repeat_interleave(2, dim=-1)[:, :, None, :] for t in table.chunk(2, dim=-1)
    )
    rotary = int(module.rotary_dim or d_head)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        turned = x[..., :rotary] * cos + _rotate_every_two(x[..., :rotary]) * sin
        return torch.cat((turned, x[..., rotary:]), dim=-1).transpose(1, 2)

    query = _fire_bhpd(site.q, rotate(query))
    key = _fire_bhpd(site.k, rotate(key))
    value = _fire_bhpd(site.v, value)
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    scores = torch.matmul(query.to(torch.float32), key.to(torch.float32).transpose(-1, -2))
    scores = scores / module.scale_attn
    allowed = _allowed(attention_mask, q_len, key.shape[-2], scores.device)
    scores, row_valid = _masked_scores(scores, allowed, site)
    pattern = _pattern(scores, row_valid, site, compute=None, out=value.dtype)
    z = torch.matmul(module.attn_dropout(pattern), value)
    out = module.resid_dropout(_z_to_output(z, site, module.out_proj))
    return out, pattern


#: Family re-implementations, by ``ArchitectureAdapter.inline_attention`` name. Each takes
#: ``(module, site, *args, **kwargs)`` as the module's ``forward`` would be called.
INLINE_FORWARDS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gpt_neo": _gpt_neo,
    "bloom": _bloom,
    "falcon_legacy": _falcon_legacy,
    "gptj_legacy": _gptj_legacy,
}

#: Families that call ``AttentionInterface`` in current transformers but computed attention
#: inline in older 5.x releases: family -> (attribute only the older module has, the
#: re-implementation to run there).
LEGACY_FORWARDS: dict[str, tuple[str, str]] = {
    "gptj": ("_attn", "gptj_legacy"),
    "falcon": ("_split_heads", "falcon_legacy"),
}


def _forward_name(
    sites: Mapping[nn.Module, AttentionSite], adapter: ArchitectureAdapter
) -> str | None:
    if adapter.inline_attention is not None:
        return adapter.inline_attention
    legacy = LEGACY_FORWARDS.get(adapter.family)
    if legacy is not None and any(hasattr(module, legacy[0]) for module in sites):
        return legacy[1]
    return None


@contextmanager
def inline_attention(
    sites: Mapping[nn.Module, AttentionSite], adapter: ArchitectureAdapter
) -> Iterator[None]:
    """Route each attention module through its hooked re-implementation for one forward.

    Does nothing for families that call ``AttentionInterface``.

    Raises:
        ConfigError: The adapter names a re-implementation that does not exist.
    """
    name = _forward_name(sites, adapter)
    if name is None:
        yield
        return
    forward = INLINE_FORWARDS.get(name)
    if forward is None:
        raise ConfigError(
            f"the {adapter.family!r} adapter sets inline_attention={name!r}, which is not one "
            f"of {sorted(INLINE_FORWARDS)}; add it to tl_driver_hf._runtime._inline_attention"
        )
    swapped: list[tuple[nn.Module, str, Any]] = []
    try:
        for module, site in sites.items():
            state = vars(module)
            # Under accelerate's hooks, forward is its wrapper around _old_forward.
            attr = "_old_forward" if "_old_forward" in state else "forward"
            swapped.append((module, attr, state.get(attr, _MISSING)))
            state[attr] = functools.partial(forward, module, site)
        yield
    finally:
        for module, attr, saved in reversed(swapped):
            if saved is _MISSING:
                vars(module).pop(attr, None)
            else:
                vars(module)[attr] = saved
