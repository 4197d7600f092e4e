"""Attention scores and patterns rebuilt from the queries and keys attention received.

vLLM's attention kernels never materialise scores or probabilities. The worker records the
queries and keys its ``Attention`` layers receive (after QK-norm, rotary embedding and any
edit) for the prompt positions of each request, and rebuilds one request's
``hook_attn_scores`` and ``hook_pattern`` from them when the run ends, with the layer's own
settings read from the ``Attention`` module: its scale, logit soft-cap, sliding window and
ALiBi slopes, grouped-query heads repeated as the kernel shares them. The conventions are
the hf driver's: scores are scaled, soft-capped where the model does, ALiBi added as
``slope * key_position`` (BLOOM's convention), and masked with ``-inf``; the pattern is their
softmax in float32. Each tensor-parallel rank rebuilds the heads it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AttentionFacts", "attention_facts", "rebuild"]


@dataclass(frozen=True)
class AttentionFacts:
    """What one attention layer on this rank computes with.

    Attributes:
        heads: Query heads on this rank.
        kv_heads: Key/value heads on this rank.
        head_dim: Width of one head.
        scale: Multiplier of ``q . k``.
        softcap: Logit soft-cap (``tanh(s / cap) * cap``), or ``None``.
        window: Sliding window (a query sees keys ``i - window < j <= i``), or ``None``.
        alibi: ALiBi slopes of this rank's heads (float32), or ``None``.
    """

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None
    window: int | None
    alibi: torch.Tensor | None


def attention_facts(attention: Any) -> AttentionFacts:
    """Read an ``vllm`` ``Attention`` layer's settings (the backend's own copies).

    Args:
        attention: A ``vllm.model_executor.layers.attention.Attention`` module.

    Returns:
        Its facts on this rank.
    """
    impl = attention.impl
    cap = getattr(impl, "logits_soft_cap", None)
    window = getattr(attention, "sliding_window", None)
    alibi = getattr(impl, "alibi_slopes", None)
    if alibi is not None:
        alibi = torch.as_tensor(alibi, dtype=torch.float32).reshape(-1)
    return AttentionFacts(
        heads=int(attention.num_heads),
        kv_heads=int(attention.num_kv_heads),
        head_dim=int(attention.head_size),
        scale=float(impl.scale),
        # Backends store "no soft-cap" as 0 or None, "no window" as None or -1.
        softcap=float(cap) if cap else None,
        window=int(window) if window is not None and int(window) > 0 else None,
        alibi=alibi,
    )


def rebuild(q: torch.Tensor, k: torch.Tensor, facts: AttentionFacts) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and pattern of one prompt from its queries and keys.

    Args:
        q: ``[pos, heads, d_head]`` queries as attention received them.
        k: ``[pos, kv_heads, d_head]`` keys as attention received them.
        facts: The layer's settings.

    Returns:
        ``(scores, pattern)``, each ``[heads, pos, pos]`` in ``q``'s dtype.
    """
    n = q.shape[0]
    queries = q.float().transpose(0, 1)
    keys = k.float().transpose(0, 1)
    if keys.shape[0] != queries.shape[0]:
        keys = keys.repeat_interleave(queries.shape[0] // keys.shape[0], dim=0)
    scores = torch.matmul(queries, keys.transpose(1, 2)) * facts.scale
    if facts.softcap is not None:
        scores = torch.tanh(scores / facts.softcap) * facts.softcap
    key_pos = torch.arange(n, device=q.device)
    if facts.alibi is not None:
        slopes = facts.alibi.to(device=q.device)
        scores = scores + slopes[:, None, None] * key_pos.float()[None, None, :]
    query_pos = key_pos[:, None]
    allowed = key_pos[None, :] <= query_pos
    if facts.window is not None:
        allowed &= query_pos - key_pos[None, :] < facts.window
    scores = scores.masked_fill(~allowed, float("-inf"))
    pattern = torch.softmax(scores, dim=-1)
    return scores.to(q.dtype), pattern.to(q.dtype)
