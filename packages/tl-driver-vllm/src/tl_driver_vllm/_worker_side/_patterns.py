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
        sinks: Attention-sink logits of this rank's heads (float32, gpt-oss), or ``None``:
            each row's softmax then also counts ``exp(sink)``, so the pattern sums to less
            than 1 (the sink takes the rest, as on the hf driver).
    """

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None
    window: int | None
    alibi: torch.Tensor | None
    sinks: torch.Tensor | None = None


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
    sinks = getattr(impl, "sinks", None)
    if sinks is not None:
        sinks = sinks.detach().float().reshape(-1)
    return AttentionFacts(
        heads=int(attention.num_heads),
        kv_heads=int(attention.num_kv_heads),
        head_dim=int(attention.head_size),
        scale=float(impl.scale),
        # Backends store "no soft-cap" as 0 or None, "no window" as None or -1.
        softcap=float(cap) if cap else None,
        window=int(window) if window is not None and int(window) > 0 else None,
        alibi=alibi,
        sinks=sinks,
    )


def rebuild(
    q: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    facts: AttentionFacts,
    *,
    chunk: int = 1 << 26,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and pattern of a batch of prompts from their queries and keys.

    Args:
        q: ``[batch, pos, heads, d_head]`` queries as attention received them (zero past
            each prompt's length).
        k: ``[batch, pos, kv_heads, d_head]`` keys as attention received them.
        lengths: ``[batch]`` prompt lengths.
        facts: The layer's settings.
        chunk: Most score entries computed at once (prompts are taken in groups).

    Returns:
        ``(scores, pattern)``, each ``[batch, heads, pos, pos]`` in ``q``'s dtype; rows and
        columns past a prompt's length hold ``-inf`` (scores) and 0 (pattern).
    """
    batch, n, heads = q.shape[0], q.shape[1], q.shape[2]
    scores = q.new_empty((batch, heads, n, n))
    pattern = q.new_empty((batch, heads, n, n))
    key_pos = torch.arange(n, device=q.device)
    query_pos = key_pos[:, None]
    allowed = key_pos[None, :] <= query_pos
    if facts.window is not None:
        allowed &= query_pos - key_pos[None, :] < facts.window
    alibi = None
    if facts.alibi is not None:
        alibi = facts.alibi.to(device=q.device)[:, None, None] * key_pos.float()[None, None, :]
    # Queries past a prompt's end see nothing: their rows come out -inf / 0.
    past = key_pos[None, :] >= lengths.to(q.device)[:, None]
    step = max(1, chunk // max(1, heads * n * n))
    for start in range(0, batch, step):
        part = slice(start, min(batch, start + step))
        queries = q[part].float().transpose(1, 2)
        keys = k[part].float().transpose(1, 2)
        if keys.shape[1] != heads:
            keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
        s = torch.matmul(queries, keys.transpose(2, 3)) * facts.scale
        if facts.softcap is not None:
            s = torch.tanh(s / facts.softcap) * facts.softcap
        if alibi is not None:
            s = s + alibi
        s = s.masked_fill(~allowed, float("-inf"))
        rows = past[part][:, None, :, None]
        if facts.sinks is None:
            p = torch.softmax(s.masked_fill(rows, 0.0), dim=-1)
        else:
            # The sink is one more logit per head in each row's softmax, with no value.
            sink = facts.sinks.to(s.device)[None, :, None, None].expand(*s.shape[:3], 1)
            p = torch.softmax(torch.cat((s.masked_fill(rows, 0.0), sink), dim=-1), dim=-1)[..., :-1]
        p = p.masked_fill(rows, 0.0)
        scores[part] = s.masked_fill(rows, float("-inf"))
        pattern[part] = p
    return scores, pattern
