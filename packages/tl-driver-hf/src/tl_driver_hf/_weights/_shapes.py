"""Read transformers weights in HookedTransformer shapes (``W_Q`` is ``[h, d_model, d_head]``)."""

from __future__ import annotations

import torch
from torch import nn

from tl_driver_hf.adapters import LinearKind

__all__ = ["head_weights", "in_out", "layer_attention_weights", "layer_mlp_weights", "bias_of"]


def in_out(module: nn.Module, kind: LinearKind) -> torch.Tensor:
    """A projection's weight as ``[in, out]`` (``x @ W``)."""
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    return weight if kind == "conv1d" else weight.T


def bias_of(module: nn.Module | None) -> torch.Tensor | None:
    """The projection's bias, or ``None``."""
    bias = getattr(module, "bias", None) if module is not None else None
    return bias if isinstance(bias, torch.Tensor) else None


def head_weights(
    o: nn.Module, kind: LinearKind, n_heads: int, d_head: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W_O [h, d_head, d_model], b_O [d_model] or None)`` of an output projection."""
    w = in_out(o, kind)
    return w.reshape(n_heads, d_head, w.shape[-1]), bias_of(o)


def _heads(w: torch.Tensor, n: int, d_head: int) -> torch.Tensor:
    """``[d_model, n * d_head]`` -> ``[n, d_model, d_head]``."""
    return w.reshape(w.shape[0], n, d_head).permute(1, 0, 2)


def _head_bias(b: torch.Tensor | None, n: int, d_head: int, like: torch.Tensor) -> torch.Tensor:
    if b is None:
        return torch.zeros(n, d_head, dtype=like.dtype, device=like.device)
    return b.reshape(n, d_head)


def layer_attention_weights(
    q: nn.Module | None,
    k: nn.Module | None,
    v: nn.Module | None,
    qkv: nn.Module | None,
    kind: LinearKind,
    n_heads: int,
    n_kv: int,
    d_head: int,
    qkv_layout: str = "blocks",
) -> dict[str, torch.Tensor]:
    """``W_Q``/``W_K``/``W_V`` (``[heads, d_model, d_head]``) and their biases for one layer.

    ``qkv_layout="heads"``: the fused projection is laid out per head ``[q_h | k_h | v_h]``.
    """
    if qkv is not None and qkv_layout == "heads":
        w = torch.unflatten(in_out(qkv, kind), -1, (n_heads, 3, d_head))
        wq, wk, wv = (w[:, :, j].flatten(-2) for j in range(3))
        bias = bias_of(qkv)
        bq: torch.Tensor | None = None
        bk: torch.Tensor | None = None
        bv: torch.Tensor | None = None
        if bias is not None:
            b3 = torch.unflatten(bias, -1, (n_heads, 3, d_head))
            bq, bk, bv = (b3[:, j].flatten() for j in range(3))
    elif qkv is not None:
        w = in_out(qkv, kind)
        sizes = [n_heads * d_head, n_kv * d_head, n_kv * d_head]
        wq, wk, wv = torch.split(w, sizes, dim=-1)
        bias = bias_of(qkv)
        bq, bk, bv = torch.split(bias, sizes) if bias is not None else (None, None, None)
    else:
        assert q is not None and k is not None and v is not None
        wq, wk, wv = in_out(q, kind), in_out(k, kind), in_out(v, kind)
        bq, bk, bv = bias_of(q), bias_of(k), bias_of(v)
    return {
        "W_Q": _heads(wq, n_heads, d_head),
        "W_K": _heads(wk, n_kv, d_head),
        "W_V": _heads(wv, n_kv, d_head),
        "b_Q": _head_bias(bq, n_heads, d_head, wq),
        "b_K": _head_bias(bk, n_kv, d_head, wk),
        "b_V": _head_bias(bv, n_kv, d_head, wv),
    }


def layer_mlp_weights(
    mlp_in: nn.Module | None,
    gate: nn.Module | None,
    up: nn.Module | None,
    gate_up: nn.Module | None,
    down: nn.Module | None,
    kind: LinearKind,
) -> dict[str, torch.Tensor | None]:
    """``W_in``/``W_gate`` (``[d_model, d_mlp]``), ``W_out`` (``[d_mlp, d_model]``), biases."""
    if gate_up is not None:
        w_gate, w_in = in_out(gate_up, kind).chunk(2, dim=-1)
        b_in = None
    elif gate is not None:
        assert up is not None
        w_gate, w_in, b_in = in_out(gate, kind), in_out(up, kind), bias_of(up)
    else:
        assert mlp_in is not None
        w_gate, w_in, b_in = None, in_out(mlp_in, kind), bias_of(mlp_in)
    assert down is not None
    return {
        "W_in": w_in,
        "W_gate": w_gate,
        "W_out": in_out(down, kind),
        "b_in": b_in,
        "b_out": bias_of(down),
    }
