"""Which slice of each head- and neuron-level site a tensor-parallel rank holds.

vLLM shards attention by head and the MLP by neuron: rank ``r`` of ``tp`` holds query heads
``[r * h/tp, (r+1) * h/tp)``, key/value heads likewise when there are at least ``tp`` of
them (else each holds one, replicated: rank ``r`` holds head ``r // (tp / n_kv)``), and
neurons ``[r * dm/tp, (r+1) * dm/tp)`` of each of the gate and up projections. A ``Shard``
says where a rank's piece of one hook sits in the full tensor, so the driver can put the
pieces together in global order (``_merge``) and each rank can cut its columns out of the
full-width edit tables (``RunState``). Residual-stream sites are replicated and have none.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shard", "layer_shards"]


@dataclass(frozen=True)
class Shard:
    """This rank's piece of one hook.

    Attributes:
        axis: The sharded axis of one prompt's tensor (``1`` for ``[pos, heads, ...]``,
            ``0`` for ``[heads, q, k]``).
        start: First global head (or neuron) held here.
        count: Heads (or neurons) held here.
        inner: Flattened features per head (or neuron): the edit-table columns of head
            ``j`` are ``[j * inner, (j + 1) * inner)``.
    """

    axis: int
    start: int
    count: int
    inner: int

    @property
    def columns(self) -> slice:
        """This rank's columns of a full-width, flattened edit table."""
        return slice(self.start * self.inner, (self.start + self.count) * self.inner)


_Q_SITES = ("attn.hook_q", "attn.hook_rot_q", "attn.hook_z")
_KV_SITES = ("attn.hook_k", "attn.hook_v", "attn.hook_rot_k")
_NORM_SITES = ("hook_in", "hook_normalized", "hook_out")


def layer_shards(
    layer: int,
    *,
    tp_rank: int,
    tp_size: int,
    heads: int,
    kv_heads: int,
    total_kv_heads: int,
    head_dim: int,
    d_model: int,
    neurons: int | None,
) -> dict[str, Shard]:
    """The shards of one layer's head- and neuron-level hooks on this rank.

    Args:
        layer: Block index.
        tp_rank: This rank.
        tp_size: Tensor-parallel ranks.
        heads: Query heads on this rank.
        kv_heads: Key/value heads on this rank.
        total_kv_heads: Key/value heads of the model.
        head_dim: Width of one head.
        d_model: Residual width (``hook_result`` holds one row per head).
        neurons: MLP neurons on this rank (``None`` without neuron sites).

    Returns:
        Hook name -> shard (empty when ``tp_size == 1``: nothing is split).
    """
    if tp_size == 1:
        return {}
    p = f"blocks.{layer}."
    q = tp_rank * heads
    kv = tp_rank * kv_heads if total_kv_heads >= tp_size else tp_rank // (tp_size // total_kv_heads)
    out: dict[str, Shard] = {}
    for name in _Q_SITES:
        out[p + name] = Shard(1, q, heads, head_dim)
    for name in _KV_SITES:
        out[p + name] = Shard(1, kv, kv_heads, head_dim)
    for norm, start, count in (("q_norm", q, heads), ("k_norm", kv, kv_heads)):
        for site in _NORM_SITES:
            out[f"{p}attn.{norm}.{site}"] = Shard(1, start, count, head_dim)
        out[f"{p}attn.{norm}.hook_scale"] = Shard(1, start, count, 1)
    out[p + "attn.hook_result"] = Shard(1, q, heads, d_model)
    out[p + "attn.hook_attn_scores"] = Shard(0, q, heads, 0)
    out[p + "attn.hook_pattern"] = Shard(0, q, heads, 0)
    if neurons is not None:
        for name in ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post"):
            out[p + name] = Shard(1, tp_rank * neurons, neurons, 1)
    return out
