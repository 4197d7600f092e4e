"""The weight rewrites behind compatibility mode, each on one kind of parameter.

Every rewrite computes in float64 and writes the result back into the parameter's own
storage, in its dtype. The large tensors (embeddings, the unembedding, stacked experts)
are processed ``ROWS`` output units at a time, so a fold never holds a float64 copy of a
whole vocabulary or expert stack.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = [
    "Projection",
    "add_to_bias",
    "center_embedding",
    "center_unembedding",
    "center_writer",
    "fold_norm",
    "fold_value_bias",
    "untie",
    "value_bias_view",
]

#: ``"linear"``: ``[out, in]``; ``"conv1d"``: ``[in, out]``; ``"experts"``: stacked
#: ``[experts, out, in]`` (transformers 5's batched mixture-of-experts weights).
Orientation = Literal["linear", "conv1d", "experts"]

#: Output units (rows) processed at once: 4096 rows of a 8192-wide weight are 256 MiB in
#: float64.
ROWS = 4096


def _blocks(rows: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(where, float64 copy)`` of consecutive row blocks of a 2-D view."""
    for start in range(0, rows.shape[0], ROWS):
        where = slice(start, start + ROWS)
        yield where, rows[where].double()


@dataclass(frozen=True)
class Projection:
    """One weight parameter (``owner.<name>``) and how it is oriented."""

    owner: nn.Module
    name: str
    orientation: Orientation

    @property
    def parameter(self) -> torch.Tensor:
        """The parameter itself."""
        return cast(torch.Tensor, getattr(self.owner, self.name))

    @property
    def has_bias(self) -> bool:
        """Whether a bias can live next to this weight (stacked experts have none here)."""
        return self.orientation != "experts"

    def matrix(self) -> torch.Tensor:
        """The weight as ``[..., in, out]`` in float64 (a copy)."""
        w = self.parameter.detach().double()
        return w if self.orientation == "conv1d" else w.transpose(-1, -2)

    def store(self, w: torch.Tensor) -> None:
        """Write ``w`` (``[..., in, out]``) back into the parameter."""
        self.parameter.data.copy_(w if self.orientation == "conv1d" else w.transpose(-1, -2))

    def rows(self) -> torch.Tensor:
        """A ``[out units, in]`` view of the parameter's storage (experts stacked)."""
        data = self.parameter.data
        if self.orientation == "conv1d":
            return data.T
        return data.view(-1, data.shape[-1])


def add_to_bias(module: nn.Module, delta: torch.Tensor) -> None:
    """Add ``delta`` to ``module.bias``, giving the module a zero bias first when it has none."""
    bias = getattr(module, "bias", None)
    weight = cast(torch.Tensor, module.weight)
    if not isinstance(bias, torch.Tensor):
        bias = nn.Parameter(
            torch.zeros(delta.shape[-1], dtype=weight.dtype, device=weight.device),
            requires_grad=weight.requires_grad,
        )
        module.bias = bias
    bias.data.copy_(bias.detach().double() + delta.to(bias.device))


def _norm_scale(
    norm: nn.Module, adapter: ArchitectureAdapter, size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the norm multiplies by and adds once normalised (Gemma's ``1 + w`` applied)."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        w = weight.detach().double()
        if adapter.description.norm == "rms_plus_one":
            w = w + 1.0
    else:
        w = torch.ones(size, dtype=torch.float64)
    bias = getattr(norm, "bias", None)
    return w, bias.detach().double() if isinstance(bias, torch.Tensor) else None


def _make_identity(norm: nn.Module, adapter: ArchitectureAdapter) -> None:
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        weight.data.fill_(0.0 if adapter.description.norm == "rms_plus_one" else 1.0)
    bias = getattr(norm, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.data.zero_()


def fold_norm(
    norm: nn.Module, readers: list[Projection], adapter: ArchitectureAdapter, center: bool
) -> None:
    """Fold ``norm``'s weight (and bias) into every projection reading its output.

    ``W <- w[:, None] * W`` and ``b <- b + ln_b @ W`` (with the weight before scaling);
    with ``center`` the folded weight also loses its mean over ``d_model``, which changes
    nothing a LayerNorm's zero-mean output can see. The norm becomes the identity.
    """
    w, b = _norm_scale(norm, adapter, readers[0].rows().shape[-1])
    for reader in readers:
        rows = reader.rows()
        scale = w.to(rows.device)
        delta = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
        for where, block in _blocks(rows):
            if b is not None:
                delta[where] = block @ b.to(rows.device)
            block = block * scale
            if center:
                block = block - block.mean(dim=-1, keepdim=True)
            rows[where] = block.to(rows.dtype)
        if b is not None:
            assert reader.has_bias, "checked by the plan: a norm bias never meets stacked experts"
            add_to_bias(reader.owner, delta)
    _make_identity(norm, adapter)


def center_writer(projection: Projection) -> None:
    """Remove the mean over ``d_model`` from what a projection writes (weight and bias)."""
    W = projection.matrix()
    projection.store(W - W.mean(dim=-1, keepdim=True))
    bias = getattr(projection.owner, "bias", None)
    if isinstance(bias, torch.Tensor):
        b = bias.detach().double()
        bias.data.copy_(b - b.mean())


def center_embedding(module: nn.Module) -> None:
    """Remove the mean over ``d_model`` from every row of an embedding table."""
    rows = cast(torch.Tensor, module.weight).data
    for where, block in _blocks(rows):
        rows[where] = (block - block.mean(dim=-1, keepdim=True)).to(rows.dtype)


def center_unembedding(head: nn.Module) -> None:
    """Remove the mean over the vocabulary from the unembedding and its bias."""
    rows = Projection(head, "weight", "linear").rows()  # [vocab, d_model]
    total = torch.zeros(rows.shape[1], dtype=torch.float64, device=rows.device)
    for _, block in _blocks(rows):
        total += block.sum(dim=0)
    mean = total / rows.shape[0]
    for where, block in _blocks(rows):
        rows[where] = (block - mean).to(rows.dtype)
    bias = getattr(head, "bias", None)
    if isinstance(bias, torch.Tensor):
        b = bias.detach().double()
        bias.data.copy_(b - b.mean())


def value_bias_view(
    v: nn.Module | None,
    qkv: nn.Module | None,
    adapter: ArchitectureAdapter,
    n_heads: int,
    n_kv: int,
    d_head: int,
) -> torch.Tensor | None:
    """The value bias as a ``[n_kv, d_head]`` view into its parameter, or ``None``."""
    module = qkv if qkv is not None else v
    bias = getattr(module, "bias", None)
    if not isinstance(bias, torch.Tensor):
        return None
    if qkv is None:
        return bias.data.view(n_kv, d_head)
    if adapter.qkv_layout == "heads":
        # Per head [q_h | k_h | v_h] (GPT-NeoX, BLOOM): one key/value head per query head.
        return bias.data.view(n_heads, 3, d_head)[:, 2]
    return bias.data[(n_heads + n_kv) * d_head :].view(n_kv, d_head)


def fold_value_bias(b_v: torch.Tensor, o: Projection, n_heads: int, n_kv: int, d_head: int) -> None:
    """Move the value bias into the output bias: ``b_O += sum_h b_V[h] @ W_O[h]``.

    Exact because each row of an attention pattern sums to one; grouped key/value heads
    serve every query head of their group.
    """
    per_head = b_v.double().repeat_interleave(n_heads // n_kv, dim=0)
    W_O = o.matrix().reshape(n_heads, d_head, -1)
    add_to_bias(o.owner, torch.einsum("he,hed->d", per_head.to(W_O.device), W_O))
    b_v.zero_()


def untie(head: nn.Module, embed: nn.Module) -> None:
    """Give the unembedding its own weight when it shares the embedding's."""
    weight = cast(torch.Tensor, head.weight)
    other = cast(torch.Tensor, embed.weight)
    if weight is other or weight.data_ptr() == other.data_ptr():
        head.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
