"""The hooked attention function, registered with transformers' ``AttentionInterface``.

transformers' attention modules project q/k/v, rotate q/k and then call the function that
``config._attn_implementation`` names. While the driver runs a forward it points that
name at ``tl_hooked`` (and restores it afterwards). That function fires the attention
internals as canonical hooks and computes exactly what eager attention computes:
``softmax(q k^T * scaling [soft-capped] masked) v`` with grouped-query heads repeated, the
softmax in float32 where the family's eager code does so. In float32 with none of those
hooks attached it calls transformers' SDPA function instead (within ~1e-5 of eager; see
the driver docs for the measured drift); in half precision it always computes eagerly,
so attaching a hook never changes a bf16 model's output.

Masks come from transformers' boolean SDPA mask builder (registered under the same name),
so sliding windows and padding arrive already combined; a query row with no key to attend
to (left padding) gets an all-zero pattern, as SDPA and the native driver give.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tl_core import HookPoint
from tl_core.driver_api import only_rerouted
from tl_driver_hf._runtime._arena import CaptureArena

__all__ = ["ATTN_IMPLEMENTATION", "AttentionSite", "attention_sites", "hooked_attention"]

ATTN_IMPLEMENTATION = "tl_hooked"


@dataclass
class AttentionSite:
    """The hook points one attention module fires, and how its family computes attention.

    ``q``/``k`` are ``hook_rot_q``/``hook_rot_k`` on rotary families and ``hook_q``/``hook_k``
    otherwise: attention receives the final queries and keys either way.
    """

    q: HookPoint | None
    k: HookPoint | None
    v: HookPoint
    scores: HookPoint
    pattern: HookPoint
    z: HookPoint
    softmax_fp32: bool
    #: Where the scores, pattern and ``z`` go when hooks hold them (``_arena``).
    arena: CaptureArena | None = None

    def needs_explicit(self, softcap: float | None, dtype: torch.dtype) -> bool:
        """Whether to compute attention step by step rather than call SDPA.

        Always in half precision, where SDPA and eager differ by far more than 1e-5 (so
        attaching a pattern hook would change the model's output), with soft-capping
        (SDPA has none), and whenever a hook inside attention is attached.
        """
        if softcap is not None or dtype not in _FAST_DTYPES:
            return True
        points = (self.q, self.k, self.v, self.scores, self.pattern)
        return any(p is not None and p.has_hooks for p in points)


_SITES: dict[int, AttentionSite] = {}
# SDPA stays within ~1e-5 of eager attention in these dtypes (see the driver docs).
_FAST_DTYPES = (torch.float32, torch.float64)


@contextmanager
def attention_sites(sites: dict[nn.Module, AttentionSite]) -> Iterator[None]:
    """Make ``hooked_attention`` find each module's site for the duration of a forward."""
    keys = [id(module) for module in sites]
    _SITES.update({id(module): site for module, site in sites.items()})
    try:
        yield
    finally:
        for key in keys:
            _SITES.pop(key, None)


def _fire_bhpd(point: HookPoint | None, x: torch.Tensor) -> torch.Tensor:
    """Fire a ``b p h dh`` hook on a ``b h p dh`` tensor; edits come back transposed."""
    if point is None or not point.has_hooks:
        return x
    seen = x.transpose(1, 2)
    out = point(seen)
    # Backward hooks sit on ``seen``, so it must stay in the graph when there are any.
    return x if out is seen and not point.has_backward_hooks else out.transpose(1, 2)


def _allowed(
    attention_mask: torch.Tensor | None,
    q_len: int,
    k_len: int,
    device: torch.device,
    *,
    causal: bool = True,
) -> torch.Tensor:
    if attention_mask is not None:
        return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if not causal:
        # An encoder without padding: transformers skips the mask, every key is allowed.
        return torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=device)
    # No mask means plain causal, aligned at the end (queries are the last q_len keys).
    rows = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    return (torch.arange(k_len, device=device)[None, :] <= rows)[None, None]


def hooked_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eager attention with canonical hooks (``query`` ``[b, h, q, dh]`` after rotary).

    Returns:
        ``(z [b, q, h, dh], pattern [b, h, q, k] or None)`` as transformers expects.
    """
    site = _SITES.get(id(module))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # Attention sinks (gpt-oss): one extra logit per head that takes softmax mass and no value.
    sinks: torch.Tensor | None = kwargs.pop("s_aux", None)
    if site is not None and sinks is None and not site.needs_explicit(softcap, query.dtype):
        z, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return site.z(z) if site.z.has_hooks else z, None
    given = (query, key, value)
    if site is not None:
        query = _fire_bhpd(site.q, query)
        key = _fire_bhpd(site.k, key)
        value = _fire_bhpd(site.v, value)
    fired = list(zip(given, (query, key, value), strict=True))
    n_rep = query.shape[1] // key.shape[1]
    # In place where eager attention makes a new tensor: the same bits, and with every hook
    # captured each fresh [b, h, q, k] buffer is memory the forward touches for the first time.
    # (Neither a matmul's nor a scalar multiply's backward reads its own output.)
    keys_t = repeat_kv(key, n_rep).transpose(2, 3)
    scores = _matmul(
        query, keys_t, _buffer(site, "scores", (*query.shape[:3], keys_t.shape[-1]), query)
    )
    scores = scores.mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        # A float (additive) mask, as eager attention adds it.
        scores = scores + attention_mask
        allowed = None
    else:
        # As transformers' SDPA reads it: the call's is_causal, else the module's.
        declared = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if declared is None else declared)
        allowed = _allowed(
            attention_mask, query.shape[2], key.shape[2], query.device, causal=causal
        )
        scores = scores.masked_fill_(~allowed, float("-inf"))
    if site is not None and site.scores.has_hooks:
        fired.append((scores, site.scores(scores)))
        scores = fired[-1][1]
    fp32 = site.softmax_fp32 if site is not None else True
    row_valid = None if allowed is None else allowed.any(dim=-1, keepdim=True)
    if sinks is not None:
        column = (
            sinks.reshape(1, -1, 1, 1)
            .expand(scores.shape[0], -1, scores.shape[2], 1)
            .to(scores.dtype)
        )
        combined = torch.cat((scores, column), dim=-1)
        # As the family's eager code: shift by the row maximum (sink included), softmax in
        # the logits' dtype, then drop the sink's column.
        combined = combined - combined.max(dim=-1, keepdim=True).values
        pattern = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(value.dtype)
    elif row_valid is not None and not bool(row_valid.all()):
        # A row of only -inf softmaxes to NaN, and NaN * 0 would still reach real tokens.
        pattern = _softmax(scores.masked_fill(~row_valid, 0.0), fp32, value.dtype)
        pattern = pattern.masked_fill(~row_valid, 0.0)
    else:
        pattern = _softmax(scores, fp32, value.dtype, _buffer(site, "pattern", scores.shape, value))
    if site is not None and site.pattern.has_hooks:
        fired.append((pattern, site.pattern(pattern)))
        pattern = fired[-1][1]
    pattern = F.dropout(pattern, p=dropout, training=module.training)
    z = torch.matmul(pattern, repeat_kv(value, n_rep)).transpose(1, 2)
    z_buffer = _buffer(site, "z", z.shape, z)
    z = z.contiguous() if z_buffer is None else z_buffer.copy_(z)
    if softcap is None and sinks is None and query.dtype in _FAST_DTYPES and only_rerouted(*fired):
        # The hooks handed on equal values and only change the gradient (relevance rules,
        # probes, backward hooks): keep SDPA's bits, the explicit path's gradient.
        fast, _ = sdpa_attention_forward(
            module, *given, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        z = fast.detach() + (z - z.detach())
    if site is not None and site.z.has_hooks:
        z = site.z(z)
    return z, pattern


def _buffer(
    site: AttentionSite | None, point: str, shape: tuple[int, ...] | torch.Size, like: torch.Tensor
) -> torch.Tensor | None:
    """An arena buffer for a value a hook at ``point`` sees (hooks may keep it), or ``None``."""
    if site is None or site.arena is None or not getattr(site, point).has_hooks:
        return None
    return site.arena.empty(shape, like)


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)


def _softmax(
    scores: torch.Tensor, fp32: bool, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    if out is not None and scores.dtype == dtype and (scores.dtype == torch.float32 or not fp32):
        # The same kernel as below, written into ``out`` (no dtype conversion to make).
        return torch.softmax(scores, -1, out=out)
    if fp32:
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    return F.softmax(scores, dim=-1).to(dtype)


AttentionInterface.register(ATTN_IMPLEMENTATION, hooked_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
