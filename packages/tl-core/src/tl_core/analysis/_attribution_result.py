"""What attribution patching returns: node and edge scores, ranked with readable labels."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tl_core._errors import UserError

__all__ = ["AttributionResult", "EdgeScore", "NodeScore", "node_label"]

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


class NodeScore(NamedTuple):
    """One node's score: a site at one position (and head, for per-head sites)."""

    label: str
    site: str
    position: int | None
    head: int | None
    score: float


class EdgeScore(NamedTuple):
    """One writer -> reader edge's score, summed over positions."""

    label: str
    writer: str
    reader: str
    score: float


def node_label(site: str, position: int | None, head: int | None) -> str:
    """``"L3H5 attn.hook_z @7"``: layer, head, the site within the block, position."""
    match = _BLOCK.fullmatch(site)
    head_tag = "" if head is None else f"H{head}"
    if match is None:
        where = site if head is None else f"{site} {head_tag}"
    else:
        where = f"L{match.group(1)}{head_tag} {match.group(2)}"
    return where if position is None else f"{where} @{position}"


@dataclass
class AttributionResult:
    """Attribution-patching scores: first-order estimates of patching clean into corrupt.

    A score estimates ``metric(corrupt run with this node or edge patched to its clean
    value) - metric(corrupt run)``. With a per-prompt metric (``[batch]``) scores are
    averaged over the clean/corrupt pairs; with a scalar metric they are summed, so they
    estimate the change of that scalar.

    Attributes:
        nodes: Site -> score tensor averaged over pairs, axes named in ``node_axes``.
        node_axes: Site -> the axes of its score (``"p"``, ``"p h"``, ``"h q"``, ...).
        nodes_per_pair: Site -> scores with a leading pair axis.
        writers: Edge-graph writers in forward order (``"embed"``, ``"L0H1"``, ``"L0MLP"``).
        readers: Edge-graph readers (``"L1H0.q"``, ``"L1KV0.k"`` with grouped keys,
            ``"L1MLP"``, ``"logits"``).
        edges: ``[writer, reader]`` scores averaged over pairs (``None`` without edges).
        edges_per_pair: ``[pair, writer, reader]``.
        edge_mask: ``[writer, reader]``: whether the writer can reach the reader at all
            (scores of other pairs are 0 and never ranked).
        metric_clean: The metric of the clean run (per pair, or the scalar).
        metric_corrupt: The metric of the corrupt run.
    """

    nodes: dict[str, torch.Tensor] = field(default_factory=dict)
    node_axes: dict[str, str] = field(default_factory=dict)
    nodes_per_pair: dict[str, torch.Tensor] = field(default_factory=dict)
    writers: list[str] = field(default_factory=list)
    readers: list[str] = field(default_factory=list)
    edges: torch.Tensor | None = None
    edges_per_pair: torch.Tensor | None = None
    edge_mask: torch.Tensor | None = None
    metric_clean: torch.Tensor | None = None
    metric_corrupt: torch.Tensor | None = None

    def node_scores(self) -> list[NodeScore]:
        """Every node's score, unranked."""
        out: list[NodeScore] = []
        for site, scores in self.nodes.items():
            axes = self.node_axes[site].split()
            for index in torch.cartesian_prod(*(torch.arange(n) for n in scores.shape)).reshape(
                -1, scores.ndim
            ):
                named = dict(zip(axes, index.tolist(), strict=True))
                position = named.get("p", named.get("q"))
                head = named.get("h")
                value = float(scores[tuple(index.tolist())])
                out.append(NodeScore(node_label(site, position, head), site, position, head, value))
        return out

    def top_nodes(self, k: int = 10, *, sites: list[str] | None = None) -> list[NodeScore]:
        """The ``k`` nodes with the largest ``|score|``, optionally only at ``sites``.

        Raises:
            UserError: No node scores, unknown ``sites``, or a score that is NaN or inf.
        """
        if not self.nodes:
            raise UserError(
                "this result has no node scores: run with granularity='node' or 'both'."
            )
        if sites is not None:
            unknown = sorted(set(sites) - set(self.nodes))
            if unknown:
                raise UserError(
                    f"top_nodes: no scores for {unknown}; scored sites: {sorted(self.nodes)}."
                )
        pool = [n for n in self.node_scores() if sites is None or n.site in sites]
        unranked = [n.label for n in pool if not math.isfinite(n.score)]
        if unranked:
            raise UserError(
                f"top_nodes: {len(unranked)} node score(s) are not finite (e.g. "
                f"{unranked[:3]}), so no ranking is meaningful; recompute the scores with a "
                "finite metric (attribution_patch refuses NaN and inf metrics)."
            )
        return sorted(pool, key=lambda n: -abs(n.score))[:k]

    def top_edges(self, k: int = 10) -> list[EdgeScore]:
        """The ``k`` edges with the largest ``|score|`` among those the graph allows.

        Raises:
            UserError: No edge scores, or a score that is NaN or inf.
        """
        if self.edges is None or self.edge_mask is None:
            raise UserError(
                "this result has no edge scores: run with granularity='edge' or 'both'."
            )
        if not bool(torch.isfinite(self.edges[self.edge_mask]).all()):
            raise UserError(
                "top_edges: some edge scores are not finite, so no ranking is meaningful; "
                "recompute the scores with a finite metric (attribution_patch refuses NaN "
                "and inf metrics)."
            )
        masked = torch.where(self.edge_mask, self.edges.abs(), torch.full_like(self.edges, -1.0))
        count = min(k, int(self.edge_mask.sum()))
        flat = masked.flatten().topk(count).indices
        n_readers = len(self.readers)
        out = []
        for index in flat.tolist():
            w, r = divmod(index, n_readers)
            writer, reader = self.writers[w], self.readers[r]
            out.append(EdgeScore(f"{writer} -> {reader}", writer, reader, float(self.edges[w, r])))
        return out

    def edge(self, writer: str, reader: str) -> float:
        """The score of one edge, by its labels."""
        if self.edges is None:
            raise UserError(
                "this result has no edge scores: run with granularity='edge' or 'both'."
            )
        for label, pool in ((writer, self.writers), (reader, self.readers)):
            if label not in pool:
                raise UserError(
                    f"no edge endpoint {label!r}; known: {pool[:6]}... ({len(pool)} in all)"
                )
        return float(self.edges[self.writers.index(writer), self.readers.index(reader)])

    def summary(self, k: int = 5) -> str:
        """The top nodes and edges as a few readable lines."""
        lines = []
        if self.metric_clean is not None and self.metric_corrupt is not None:
            lines.append(
                f"metric: clean {float(self.metric_clean.float().mean()):+.4f}, "
                f"corrupt {float(self.metric_corrupt.float().mean()):+.4f}"
            )
        if self.nodes:
            lines.append("top nodes:")
            lines.extend(f"  {n.label:<32} {n.score:+.4f}" for n in self.top_nodes(k))
        if self.edges is not None:
            lines.append("top edges:")
            lines.extend(f"  {e.label:<32} {e.score:+.4f}" for e in self.top_edges(k))
        return "\n".join(lines)

    def __repr__(self) -> str:
        edges = (
            "none"
            if self.edges is None
            else f"{len(self.writers)} writers x {len(self.readers)} readers"
        )
        return f"AttributionResult(sites={len(self.nodes)}, edges={edges})"
