"""HookedTransformer's processed weights, recomputed from a plain state dict and ``PATHS``.

Written from the processing's definition, not from the driver: every weight is read from
the transformers state dict by the paths in ``tests/_paths.py``, turned into ``[in, out]``
matrices in float64, and processed in an order different from the driver's (value biases
move into the output bias before the writers are centred; the two orders agree because
centring is linear). The result maps each state-dict key that processing defines to its
expected value and to how the stored tensor is oriented.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Tensor = torch.Tensor
#: How a stored weight maps to ``[in, out]``: "t" (nn.Linear, transpose the last two
#: axes), "as_is" (Conv1D weights, vectors, embedding tables).
Orientation = str


def in_out(stored: Tensor, orientation: Orientation) -> Tensor:
    """A stored tensor in ``[..., in, out]`` orientation."""
    return stored.transpose(-1, -2) if orientation == "t" else stored


def expected_processing(
    p: dict[str, Any],
    sd: dict[str, Tensor],
    *,
    n_heads: int,
    n_kv: int,
    center_unembed: bool = True,
) -> dict[str, tuple[Tensor, Orientation]]:
    """Every key processing defines -> (expected value in ``[in, out]``, orientation)."""
    layer_norm = p["norm"] == "layernorm"
    plus_one = p["norm"] == "rms_plus_one"
    proj: Orientation = "as_is" if p.get("conv1d") else "t"
    out: dict[str, tuple[Tensor, Orientation]] = {}

    def current(key: str, orientation: Orientation) -> Tensor:
        return out[key][0] if key in out else in_out(sd[key], orientation)

    def fold(norm: str, readers: list[tuple[str, Orientation]]) -> None:
        w = sd[f"{norm}.weight"] + (1.0 if plus_one else 0.0)
        b = sd.get(f"{norm}.bias")
        for key, orientation in readers:
            W = current(f"{key}.weight", orientation)
            if b is not None:
                bias = sd.get(f"{key}.bias", torch.zeros(W.shape[-1], dtype=W.dtype))
                out[f"{key}.bias"] = (bias + b @ W, "as_is")
            W = W * w[:, None]
            if layer_norm:
                W = W - W.mean(-2, keepdim=True)
            out[f"{key}.weight"] = (W, orientation)
        out[f"{norm}.weight"] = (torch.full_like(w, 0.0 if plus_one else 1.0), "as_is")
        if b is not None:
            out[f"{norm}.bias"] = (torch.zeros_like(b), "as_is")

    def centred(x: Tensor) -> Tensor:
        return x - x.mean(-1, keepdim=True) if layer_norm else x

    def write(key: str) -> None:
        W = current(f"{key}.weight", proj)
        out[f"{key}.weight"] = (centred(W), proj)
        if f"{key}.bias" in out or f"{key}.bias" in sd:
            out[f"{key}.bias"] = (centred(current(f"{key}.bias", "as_is")), "as_is")

    embeds = [p["embed"], *([p["pos"]] if "pos" in p else [])]
    n_layers = 1 + max(
        int(k[len(p["layers"]) + 1 :].split(".")[0]) for k in sd if k.startswith(p["layers"] + ".")
    )
    for i in range(n_layers):
        base = f"{p['layers']}.{i}."
        attn, mlp = base + p["attn"], base + p["mlp"] + ("." if p["mlp"] else "")
        attention = [(f"{attn}.{p[r]}", proj) for r in ("q", "k", "v", "qkv") if r in p]
        mlp_readers = [(f"{mlp}{p[r]}", proj) for r in ("pre", "pre_linear", "gate_up") if r in p]
        if "router" in p:
            mlp_readers.append((f"{mlp}{p['router']}", "t"))
        if "ln2" in p:
            if "ln1" in p:
                fold(base + p["ln1"], attention)
            fold(base + p["ln2"], mlp_readers)
        elif "ln1" in p:
            fold(base + p["ln1"], attention + (mlp_readers if p.get("parallel") else []))
        if "experts_in" in p:
            # Stacked experts are bare parameters (no ".weight"), [experts, out, d_model].
            key = f"{mlp}{p['experts_in']}"
            w = sd[f"{base}{p['ln2']}.weight"]
            out[key] = (in_out(sd[key], "t") * w[:, None], "t")
        _fold_value_bias(p, out, sd, attn, proj, n_heads, n_kv, current)
        write(f"{attn}.{p['o']}")
        if "down" in p:
            write(f"{mlp}{p['down']}")
    for key in embeds:
        out[f"{key}.weight"] = (centred(sd[f"{key}.weight"]), "as_is")
    head = p["head"]
    if f"{head}.weight" not in sd:  # tied: the unembedding starts as the embedding
        sd = {**sd, f"{head}.weight": sd[f"{p['embed']}.weight"]}
    fold(p["final"], [(head, "t")])
    if center_unembed:
        W_U, _ = out[f"{head}.weight"]
        out[f"{head}.weight"] = (W_U - W_U.mean(-1, keepdim=True), "t")
        if f"{head}.bias" in out:
            b_U, _ = out[f"{head}.bias"]
            out[f"{head}.bias"] = (b_U - b_U.mean(), "as_is")
    return out


def _fold_value_bias(
    p: dict[str, Any],
    out: dict[str, tuple[Tensor, Orientation]],
    sd: dict[str, Tensor],
    attn: str,
    proj: Orientation,
    n_heads: int,
    n_kv: int,
    current: Callable[[str, Orientation], Tensor],
) -> None:
    key = f"{attn}.{p['qkv']}.bias" if "qkv" in p else f"{attn}.{p['v']}.bias"
    if key not in out and key not in sd:
        return
    bias = current(key, "as_is").clone()
    o = f"{attn}.{p['o']}"
    W_O = current(f"{o}.weight", proj)
    d_head = W_O.shape[0] // n_heads
    if p.get("qkv_interleaved"):
        grid = bias.view(n_heads, 3, d_head)
        b_V = grid[:, 2].clone()
        grid[:, 2] = 0.0
    elif "qkv" in p:
        start = (n_heads + n_kv) * d_head
        b_V = bias[start:].view(n_kv, d_head).clone()
        bias[start:] = 0.0
    else:
        b_V = bias.view(n_kv, d_head).clone()
        bias.zero_()
    out[key] = (bias, "as_is")
    b_O = (
        current(f"{o}.bias", "as_is")
        if f"{o}.bias" in sd
        else torch.zeros(W_O.shape[1], dtype=W_O.dtype)
    )
    group = n_heads // n_kv
    for h in range(n_heads):
        b_O = b_O + b_V[h // group] @ W_O[h * d_head : (h + 1) * d_head]
    out[f"{o}.bias"] = (b_O, "as_is")
