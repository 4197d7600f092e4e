"""The residual stream's writer -> reader graph, and its edge scores from one sweep.

Writers: the embeddings (what enters block 0), each head's result (``hook_z`` through its
slice of ``W_O``), each MLP's output. Readers: each head's q/k/v input (its own copy, from
split inputs), each MLP's input, and the final residual (the logits). Sequential blocks let
a block's MLP read its own heads; parallel blocks do not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tl_core._errors import UnsupportedFeatureError

__all__ = ["EdgeGraph", "edge_graph", "edge_scores"]

_QKV = ("q", "k", "v")


@dataclass(frozen=True)
class EdgeGraph:
    """Writers, readers and which writer can reach which reader, for one model.

    Attributes:
        n_layers: Blocks.
        n_heads: Query heads per block.
        n_kv_heads: Key/value heads per block.
        parallel: Whether attention and MLP read the same block input.
        writers: Writer labels in forward order.
        readers: Reader labels in forward order.
        mask: ``[writer, reader]``: the writer is upstream of the reader.
        W_O: ``[n_layers, n_heads, d_head, d_model]``: each head's output projection.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel: bool
    writers: list[str]
    readers: list[str]
    mask: torch.Tensor
    W_O: torch.Tensor

    @property
    def value_sites(self) -> tuple[str, ...]:
        """Sites whose clean and corrupt values give the writers' deltas."""
        per_layer = [
            (f"blocks.{i}.attn.hook_z", f"blocks.{i}.mlp.hook_out") for i in range(self.n_layers)
        ]
        return ("blocks.0.hook_in", *(s for pair in per_layer for s in pair))

    @property
    def gradient_sites(self) -> tuple[str, ...]:
        """Sites whose gradients give the readers' input gradients (and the writers' values)."""
        sites: list[str] = list(self.value_sites)
        for i in range(self.n_layers):
            sites += [f"blocks.{i}.attn.hook_{x}_input" for x in _QKV]
            sites.append(f"blocks.{i}.hook_in" if self.parallel else f"blocks.{i}.ln2.hook_in")
            sites.append(f"blocks.{i}.hook_out")
        return tuple(dict.fromkeys(sites))


def edge_graph(model: Any) -> EdgeGraph:
    """The edge graph of ``model``'s structure.

    Raises:
        UnsupportedFeatureError: Sublayer outputs normalised before the residual stream
            (sandwich norms) or the stream normalised after each sublayer (post-LN): writers
            are not additive; or no per-head output weights.
    """
    info = model.namespace.info
    if info.post_residual_norm:
        raise UnsupportedFeatureError(
            f"edge attribution on {info.architecture or 'this model'}: its blocks normalise the "
            "residual stream after every sublayer (post-LN), so no reader sees a sum of the "
            "writers' outputs. Use granularity='node'."
        )
    if info.sandwich_norm:
        raise UnsupportedFeatureError(
            f"edge attribution on {info.architecture or 'this model'}: each sublayer's output goes "
            "through its own norm before it joins the residual stream, so the writers' deltas do "
            "not add up at a reader. Use granularity='node'."
        )
    try:
        w_o = model.W_O
    except AttributeError as error:
        raise UnsupportedFeatureError(
            f"edge attribution needs each head's output weights (model.W_O): {error}"
        ) from None
    expected = (info.n_layers, info.n_heads, info.d_head, info.d_model)
    if tuple(w_o.shape) != expected:
        raise UnsupportedFeatureError(
            f"edge attribution needs W_O as [n_layers, n_heads, d_head, d_model] = {expected}, "
            f"got {tuple(w_o.shape)}."
        )
    kv = info.kv_heads
    writers, w_layer, w_kind = ["embed"], [-1], ["embed"]
    readers, r_layer, r_kind = [], [], []
    for i in range(info.n_layers):
        writers += [f"L{i}H{h}" for h in range(info.n_heads)] + [f"L{i}MLP"]
        w_layer += [i] * (info.n_heads + 1)
        w_kind += ["head"] * info.n_heads + ["mlp"]
        kv_tag = "H" if kv == info.n_heads else "KV"
        readers += [f"L{i}H{h}.q" for h in range(info.n_heads)]
        readers += [f"L{i}{kv_tag}{h}.{x}" for x in "kv" for h in range(kv)]
        readers.append(f"L{i}MLP")
        r_layer += [i] * (info.n_heads + 2 * kv + 1)
        r_kind += ["attn"] * (info.n_heads + 2 * kv) + ["mlp"]
    readers.append("logits")
    r_layer.append(info.n_layers)
    r_kind.append("logits")
    mask = torch.zeros(len(writers), len(readers), dtype=torch.bool)
    for w, (lw, kw) in enumerate(zip(w_layer, w_kind, strict=True)):
        for r, (lr, kr) in enumerate(zip(r_layer, r_kind, strict=True)):
            same_block_mlp = (
                kw == "head" and kr == "mlp" and lr == lw and not info.parallel_attn_mlp
            )
            mask[w, r] = lr > lw or same_block_mlp
    return EdgeGraph(
        info.n_layers,
        info.n_heads,
        kv,
        info.parallel_attn_mlp,
        writers,
        readers,
        mask,
        w_o.detach(),
    )


def edge_scores(
    graph: EdgeGraph,
    clean: Mapping[str, torch.Tensor],
    corrupt: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    real_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([pair, writer, reader] scores summed over positions, the graph's mask)``.

    ``real_positions`` is the batch's ``[batch, pos]`` attention mask: padding scores 0.
    """
    reader_grads = _reader_gradients(graph, grads)
    dtype = reader_grads.dtype
    real = real_positions.to(reader_grads.device, dtype)[:, :, None, None]
    pieces = []
    for delta in _writer_deltas(graph, clean, corrupt, dtype):
        pieces.append(torch.einsum("bpwd,bprd->bwr", delta * real, reader_grads))
    scores = torch.cat(pieces, dim=1)
    mask = graph.mask.to(scores.device)
    return scores * mask, mask


def _reader_gradients(graph: EdgeGraph, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, pos, reader, d_model]``: the gradient at each reader's own input."""
    sample = grads["blocks.0.hook_out"]
    dtype = torch.promote_types(sample.dtype, torch.float32)
    out = []
    for i in range(graph.n_layers):
        copies = [grads[f"blocks.{i}.attn.hook_{x}_input"].to(dtype) for x in _QKV]
        after = grads[f"blocks.{i}.hook_out"].to(dtype)
        if graph.parallel:
            # The block input feeds the skip, attention's per-head copies and the MLP.
            mlp = grads[f"blocks.{i}.hook_in"].to(dtype) - after - sum(c.sum(dim=2) for c in copies)
        else:
            # ln2.hook_in (resid_mid) feeds the skip and the MLP.
            mlp = grads[f"blocks.{i}.ln2.hook_in"].to(dtype) - after
        out += [*copies, mlp[:, :, None]]
    out.append(grads[f"blocks.{graph.n_layers - 1}.hook_out"].to(dtype)[:, :, None])
    return torch.cat(out, dim=2)


def _writer_deltas(
    graph: EdgeGraph,
    clean: Mapping[str, torch.Tensor],
    corrupt: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Clean-minus-corrupt writer outputs, ``[batch, pos, writers, d_model]`` per group."""

    def delta(site: str) -> torch.Tensor:
        after = corrupt[site]
        return clean[site].to(after.device, dtype) - after.to(dtype)

    out = [delta("blocks.0.hook_in")[:, :, None]]
    for i in range(graph.n_layers):
        w_o = graph.W_O[i].to(device=out[0].device, dtype=dtype)
        out.append(torch.einsum("bphe,hed->bphd", delta(f"blocks.{i}.attn.hook_z"), w_o))
        out.append(delta(f"blocks.{i}.mlp.hook_out")[:, :, None])
    return out
