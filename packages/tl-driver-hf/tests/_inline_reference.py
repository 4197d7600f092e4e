"""Reference attention internals for families whose attention never calls ``AttentionInterface``.

GPT-Neo, BLOOM and Falcon compute attention inside their modules, so the parity test's
recording attention function never runs for them. Here the eager model's attention module
is observed from outside instead: its input (and the ALiBi / rotary tables transformers
passes it), its returned attention probabilities and its output projection's input. q, k
and v are recomputed from the projection weights with each family's layout written out
here, and the scores from the formulas of the families' papers, never from driver code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _qkv(
    kind: str, attn: nn.Module, x: torch.Tensor, n_heads: int, d_head: int
) -> tuple[torch.Tensor, ...]:
    """``(q, k, v)`` as ``[b, heads, p, dh]`` from the projection weights."""
    if kind == "gpt_neo":
        return tuple(
            (x @ proj.weight.T).unflatten(-1, (n_heads, d_head)).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
    fused = attn.query_key_value
    out = x @ fused.weight.T + (fused.bias if fused.bias is not None else 0)
    if kind == "bloom":  # [heads, (q, k, v), dh]
        per_head = out.unflatten(-1, (n_heads, 3, d_head))
        return tuple(per_head[..., j, :].transpose(1, 2) for j in range(3))
    # Falcon-7B: [q heads | one key head | one value head]
    q, k, v = out.split((n_heads * d_head, d_head, d_head), dim=-1)
    return tuple(t.unflatten(-1, (-1, d_head)).transpose(1, 2) for t in (q, k, v))


def record_inline_attention(
    kind: str,
    attn: nn.Module,
    o: nn.Module,
    n_heads: int,
    d_head: int,
    store: dict[int, dict[str, torch.Tensor]],
) -> list[RemovableHandle]:
    """Hooks on the eager model that fill ``store[id(attn)]`` with q/k/v/pattern/z/scores.

    ``q``/``k`` are what the scores are made of (rotated on Falcon); ``scores`` is unmasked.
    """
    seen: dict[str, Any] = {}

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).detach()
        seen["kwargs"] = kwargs

    def z_in(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen["z"] = args[0].detach().unflatten(-1, (n_heads, d_head))

    def after(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        x, kwargs = seen["x"], seen["kwargs"]
        with torch.no_grad():
            q, k, v = _qkv(kind, module, x, n_heads, d_head)
            if kind == "falcon":
                cos, sin = kwargs["position_embeddings"]
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            scores = q.float() @ k.float().repeat_interleave(
                q.shape[1] // k.shape[1], dim=1
            ).transpose(-1, -2)
            if kind != "gpt_neo":  # GPT-Neo was trained without the 1/sqrt(d_head)
                scores = scores / d_head**0.5
            if kind == "bloom":  # ALiBi: a per-head linear bias over key positions
                scores = scores + kwargs["alibi"].view(x.shape[0], n_heads, 1, -1)
        store[id(module)] = {
            "q": q,
            "k": k,
            "v": v,
            "pattern": out[1].detach(),
            "z": seen["z"],
            "scores": scores,
        }

    return [
        attn.register_forward_pre_hook(before, with_kwargs=True),
        o.register_forward_pre_hook(z_in),
        attn.register_forward_hook(after),
    ]
