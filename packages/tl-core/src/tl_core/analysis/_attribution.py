"""Attribution patching: every node's and edge's patching effect from one backward pass.

The score of a node is ``(a_clean - a_corrupt) . d metric / d a`` at the corrupt run, the
first-order estimate of patching that site to its clean value. The gradient is taken at
what an edit of the site reaches: each site gets a zero tensor added by a forward hook, and
the gradient of that zero is the score's second factor. The forward stays bit-identical.

Edges follow the residual stream's additive structure: a reader's input is the sum of
every upstream writer's output (embeddings, each head's result, each MLP's output), so the
edge ``writer -> reader`` scores the writer's clean-minus-corrupt delta against the
gradient at the reader's own input. Per-head readers need per-head inputs, so the sweep
runs with split q/k/v inputs on (restored afterwards, also on error). An MLP's own input
gradient is what remains of the residual's gradient once the skip path (and, on parallel
blocks, attention's per-head copies) is taken out.

On an encoder-decoder (T5, BART) the pairs are the encoder's prompts and both runs read one
decoder input; nodes lie in both stacks, each masked by its own stack's positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch

from tl_core._errors import UnsupportedFeatureError, UserError
from tl_core.analysis._attribution_result import AttributionResult
from tl_core.analysis._edges import edge_graph, edge_scores
from tl_core.analysis._metrics import call_metric, describe_metric, non_finite
from tl_core.driver_api._batching import TokenBatch
from tl_core.driver_api._request import decoder_batch
from tl_core.hooks._vocabulary import on_decoder_positions

__all__ = ["AttributionResult", "attribution_patch", "default_node_sites"]

Granularity = Literal["node", "edge", "both"]
Metric = Callable[..., torch.Tensor]

#: Layout axes a node score keeps: the pair, the position (``q`` for patterns), the head.
_KEPT_AXES = ("b", "p", "q", "h")


#: A block's node sites, in forward order (those a model does not serve are skipped).
_NODE_SUFFIXES = (
    "hook_in",
    "attn.hook_z",
    "attn.hook_result",
    "attn.hook_out",
    "cross_attn.hook_z",
    "cross_attn.hook_out",
    "mlp.hook_out",
)


def default_node_sites(model: Any) -> list[str]:
    """Residual, attention and MLP nodes of every block of every stack: the block input,
    each head's ``hook_z`` (and ``hook_result`` where served), the attention output (and
    cross-attention's, in an encoder-decoder's decoder), the MLP output."""
    namespace = model.namespace
    return [
        name
        for prefix, stack in namespace.info.stacks
        for layer in range(stack.n_layers)
        for suffix in _NODE_SUFFIXES
        if (name := f"{prefix}.{layer}.{suffix}") in namespace.served
    ]


def attribution_patch(
    model: Any,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    *,
    granularity: Granularity = "node",
    sites: Sequence[str] | None = None,
    clean_cache: Mapping[str, torch.Tensor] | None = None,
    prepend_bos: bool = True,
    decoder_input: Any = None,
) -> AttributionResult:
    """Score every node (and/or edge) by attribution patching clean into corrupt.

    Args:
        model: A bridge whose driver has gradients (native, hf).
        clean: Clean prompts: text, texts or token ids.
        corrupt: The corrupted prompts, pair by pair the same length in tokens.
        metric: ``logits -> [batch]`` (one value per pair; scores are averaged over pairs)
            or ``logits -> scalar`` (scores are summed); see ``logit_diff_metric``. Ragged
            pairs run right-padded: a metric with a ``lengths`` keyword gets each pair's
            real length (``logit_diff_metric``'s reads each prompt's own last token), and a
            metric whose gradient reaches a padded position is refused.
        granularity: ``"node"``, ``"edge"`` or ``"both"``.
        sites: Node sites (any accepted names); default ``default_node_sites(model)``.
        clean_cache: Clean activations to reuse (an ``ActivationCache`` or a mapping);
            every site this call needs must be there. Skips the clean forward.
        prepend_bos: Put BOS before text input.
        decoder_input: An encoder-decoder's decoder input, the same for the clean and the
            corrupt run (as in ``forward``: text, one id sequence, or one per pair; ``None``:
            the decoder start token alone). The metric reads the decoder's logits, and its
            ``lengths`` keyword gets the decoder's lengths.

    Returns:
        An ``AttributionResult``.

    Raises:
        UnsupportedFeatureError: The driver has no gradients, or cannot split attention
            inputs (edges), or the model normalises each sublayer's output (edges), or
            has two stacks (edges of an encoder-decoder).
        UserError: Mismatched pairs, unknown or no sites, a metric of the wrong shape,
            one that is not finite (NaN, inf) or whose gradient is not, or one that reads
            padded positions; all before any score is returned.
    """
    driver = getattr(model, "driver", None)
    if driver is None or not driver.supports("gradients"):
        raise UnsupportedFeatureError(
            f"attribution_patch needs gradients; driver {getattr(driver, 'name', driver)!r} has "
            "none. Use a local driver (native, hf)."
        )
    if granularity not in ("node", "edge", "both"):
        raise UserError(f"granularity must be 'node', 'edge' or 'both', got {granularity!r}.")
    if not callable(metric):
        raise UserError(f"metric must be a callable on logits, got {type(metric).__name__}.")
    want_nodes = granularity in ("node", "both")
    want_edges = granularity in ("edge", "both")
    if want_edges and model.namespace.info.encoder_layers is not None:
        raise UnsupportedFeatureError(
            "edge attribution follows one residual stream, and an encoder-decoder has two "
            "joined by cross-attention; score nodes instead (granularity='node'), which "
            "covers both stacks and cross-attention's heads."
        )
    clean_batch, corrupt_batch = _pairs(model, clean, corrupt, prepend_bos)
    runs = _Runs(
        model,
        decoder_input,
        decoder_batch(model.driver, model._decoder_ids(decoder_input), len(corrupt_batch.lengths)),
    )
    node_sites = _node_sites(model, sites) if want_nodes else []
    graph = edge_graph(model) if want_edges else None

    result = AttributionResult()
    with _split_inputs(model, on=want_edges):
        # Sites an edit cannot reach while heads read their own copies get their own pass.
        separate = [s for s in node_sites if s in model.namespace.read_only] if want_edges else []
        together = [s for s in node_sites if s not in separate]
        needed = [*together, *(graph.value_sites if graph else ())]
        gradient_sites = [*together, *(graph.gradient_sites if graph else ())]
        clean_values = _clean_values(runs, clean_batch, needed, clean_cache)
        values, grads, m_corrupt = _gradient_pass(runs, corrupt_batch, metric, gradient_sites)
        _node_scores(runs, result, together, clean_values, values, grads, corrupt_batch, m_corrupt)
        if graph is not None:
            result.writers, result.readers = graph.writers, graph.readers
            per_pair, result.edge_mask = edge_scores(
                graph, clean_values, values, grads, corrupt_batch.attention_mask()
            )
            result.edges_per_pair = per_pair
            result.edges = _combine(per_pair, m_corrupt)
    if separate:
        clean_values = _clean_values(runs, clean_batch, separate, clean_cache)
        values, grads, _ = _gradient_pass(runs, corrupt_batch, metric, separate)
        _node_scores(runs, result, separate, clean_values, values, grads, corrupt_batch, m_corrupt)
    result.nodes = {s: result.nodes[s] for s in node_sites}
    result.metric_corrupt = m_corrupt.detach()
    result.metric_clean = _metric_of(runs, clean_batch, metric)
    _check_scores(result, metric)
    return result


# -- inputs ---------------------------------------------------------------------------


class _Runs:
    """How one run of the sweep is made: the model, and an encoder-decoder's decoder input
    (the same for both runs), whose batch holds the positions of the decoder's sites."""

    def __init__(self, model: Any, decoder_input: Any, decoder: TokenBatch | None) -> None:
        self.model = model
        self.decoder_input = decoder_input
        self.decoder = decoder

    def forward(self, batch: TokenBatch, return_type: str | None) -> Any:
        return self.model.forward(
            batch.rows(), return_type, prepend_bos=False, decoder_input=self.decoder_input
        )

    def positions(self, site: str, batch: TokenBatch) -> TokenBatch:
        """The batch whose positions ``site`` lies over."""
        if self.decoder is not None and on_decoder_positions(site):
            return self.decoder
        return batch

    def logits_batch(self, batch: TokenBatch) -> TokenBatch:
        """The batch whose positions the logits lie over."""
        return self.decoder if self.decoder is not None else batch


def _pairs(
    model: Any, clean: Any, corrupt: Any, prepend_bos: bool
) -> tuple[TokenBatch, TokenBatch]:
    clean_batch = model._token_batch(clean, prepend_bos=prepend_bos)
    corrupt_batch = model._token_batch(corrupt, prepend_bos=prepend_bos)
    if clean_batch.ids.shape[0] != corrupt_batch.ids.shape[0]:
        raise UserError(
            f"attribution_patch needs clean/corrupt pairs: {clean_batch.ids.shape[0]} clean prompts "
            f"but {corrupt_batch.ids.shape[0]} corrupt ones."
        )
    for i, (a, b) in enumerate(zip(clean_batch.lengths, corrupt_batch.lengths, strict=True)):
        if a != b:
            raise UserError(
                f"pair {i}: the clean prompt is {a} tokens and the corrupt one {b}; attribution "
                "patching compares activations position by position, so each pair must have "
                "the same length (rephrase, or pass token ids)."
            )
    return clean_batch, corrupt_batch


def _node_sites(model: Any, sites: Sequence[str] | None) -> list[str]:
    if sites is None:
        return default_node_sites(model)
    if isinstance(sites, str):
        sites = [sites]
    if not list(sites):
        raise UserError(
            "attribution_patch: sites is empty, so there is no node to score; name the "
            "sites to score (e.g. sites=['blocks.0.hook_out']), or leave sites out for "
            "default_node_sites(model)."
        )
    names = list(dict.fromkeys(model.namespace.lookup(s) for s in sites))
    for name in names:
        axes = model.namespace.layout(name).split()
        if axes[0] != "b" or not any(a in axes for a in ("p", "q")):
            raise UserError(
                f"attribution_patch cannot score {name!r} (layout {' '.join(axes)!r}): a node "
                "needs a batch and a position axis."
            )
    return names


@contextmanager
def _split_inputs(model: Any, *, on: bool) -> Iterator[None]:
    """Per-head q/k/v inputs for the duration of the sweep, restored even on error."""
    if not on:
        yield
        return
    before = bool(model.driver.split_qkv_input)
    model.set_use_split_qkv_input(True)
    try:
        yield
    finally:
        model.set_use_split_qkv_input(before)


@contextmanager
def _frozen_parameters(module: torch.nn.Module) -> Iterator[None]:
    """No weight gradients: the pass needs activation gradients only (and leaves ``.grad``)."""
    wanted = [p for p in module.parameters() if p.requires_grad]
    for p in wanted:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in wanted:
            p.requires_grad_(True)


# -- passes ---------------------------------------------------------------------------


def _clean_values(
    runs: _Runs, batch: TokenBatch, sites: Sequence[str], cache: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    if cache is not None:
        missing = [s for s in sites if s not in cache]
        if missing:
            raise UserError(
                f"clean_cache lacks {len(missing)} site(s) this call needs, e.g. {missing[:4]}; "
                "cache them (names_filter=...) or leave clean_cache out."
            )
        for site in sites:
            found = non_finite(cache[site])
            if found is not None:
                raise UserError(
                    f"clean_cache[{site!r}] is not finite (it holds {found}), so every score "
                    "there would be NaN; cache the clean run again, or leave clean_cache out."
                )
        return {s: cache[s] for s in sites}
    values: dict[str, torch.Tensor] = {}

    def keep(site: str) -> Callable[..., None]:
        def hook(x: torch.Tensor, *, hook: Any) -> None:
            values[site] = x.detach()

        return hook

    with torch.no_grad(), runs.model.hooks([(s, keep(s)) for s in sites]):
        runs.forward(batch, None)
    return values


def _gradient_pass(
    runs: _Runs, batch: TokenBatch, metric: Metric, sites: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """The corrupt run: each site's value, the metric's gradient at it, and the metric."""
    values: dict[str, torch.Tensor] = {}
    zeros: dict[str, torch.Tensor] = {}

    def probe(site: str) -> Callable[..., torch.Tensor]:
        def hook(x: torch.Tensor, *, hook: Any) -> torch.Tensor:
            values[site] = x.detach()
            zero = torch.zeros_like(x, requires_grad=True)
            zeros[site] = zero
            return x + zero

        return hook

    with (
        torch.enable_grad(),
        _frozen_parameters(runs.model.driver.module),
        runs.model.hooks([(s, probe(s)) for s in sites]),
    ):
        logits = runs.forward(batch, "logits")
        value = _checked_metric(metric, logits, runs.logits_batch(batch), "corrupt")
        missing = [s for s in sites if s not in zeros]
        if missing:
            raise UserError(f"these sites did not fire in the forward pass: {missing[:4]}")
        if not value.requires_grad:
            raise UserError(
                f"the value of metric {describe_metric(metric)} does not depend on the "
                "logits' gradient graph (was it detached, or computed under torch.no_grad()?)."
            )
        value.sum().backward()  # type: ignore[no-untyped-call]
    grads = {s: z.grad if z.grad is not None else torch.zeros_like(z) for s, z in zeros.items()}
    _check_gradients(runs, grads, batch, metric)
    return values, grads, value.detach()


def _checked_metric(
    metric: Metric, logits: torch.Tensor, batch: TokenBatch, run: str
) -> torch.Tensor:
    """The metric of one run, refused unless it is a finite scalar or one value per pair."""
    value = call_metric(metric, logits, batch.lengths)
    name = describe_metric(metric)
    if not isinstance(value, torch.Tensor):
        raise UserError(f"metric {name} returned {type(value).__name__}; it must return a tensor.")
    if value.ndim > 1 or (value.ndim == 1 and value.shape[0] != logits.shape[0]):
        raise UserError(
            f"metric {name} returned shape {tuple(value.shape)}; return one value per pair "
            f"([{logits.shape[0]}]) or a scalar."
        )
    if not value.is_floating_point():
        raise UserError(
            f"metric {name} returned a {value.dtype} tensor; it must return floats with a "
            "gradient (a difference of logits, a log-probability, ...)."
        )
    found = non_finite(value)
    if found is not None:
        raise UserError(
            f"metric {name} returned {found} on the {run} run, which is not finite, so every "
            "score would be NaN; nothing was scored. Check the logits it reads (NaN "
            "weights?) and the arithmetic it does on them (log of 0, division by 0)."
        )
    return value


def _metric_of(runs: _Runs, batch: TokenBatch, metric: Metric) -> torch.Tensor:
    with torch.no_grad():
        logits = runs.forward(batch, "logits")
        return _checked_metric(metric, logits, runs.logits_batch(batch), "clean").detach()


def _check_gradients(
    runs: _Runs, grads: Mapping[str, torch.Tensor], batch: TokenBatch, metric: Metric
) -> None:
    """Refuse gradients that are not finite, or that reach padding (the metric read it)."""
    for site, grad in grads.items():
        found = non_finite(grad)
        if found is not None:
            raise UserError(
                f"the gradient of metric {describe_metric(metric)} at {site!r} is not finite "
                f"(it holds {found}), so the scores would be NaN or inf; nothing was scored. "
                "Avoid operations with infinite slopes in the metric (sqrt or log at 0)."
            )
        positions = runs.positions(site, batch)
        if not positions.is_ragged:
            continue
        real = positions.attention_mask().bool()
        axes = runs.model.namespace.layout(site).split()
        # Only the site's own position axis: a real query's gradient may reach the
        # (masked) padded keys of a pattern without the metric reading them.
        axis = next((i for i, a in enumerate(axes) if a in ("p", "q")), None)
        if axis is None or axes[0] != "b":
            continue
        padded = (~real).to(grad.device)
        shape = [
            padded.shape[0] if i == 0 else padded.shape[1] if i == axis else 1
            for i in range(grad.ndim)
        ]
        leaked = (grad * padded.reshape(shape)).ne(0).flatten(1).any(1).nonzero().flatten()
        if leaked.numel():
            raise UserError(
                f"metric {describe_metric(metric)} reads padded positions: its gradient "
                f"reaches the padding of pair(s) {leaked.tolist()} at {site!r} (pair lengths "
                f"{list(positions.lengths)}, padded to {real.shape[1]}). Read each prompt at its "
                "own positions: use logit_diff_metric, or give the metric a lengths keyword "
                "(attribution_patch passes each pair's real length), or pass equal-length pairs."
            )


def _check_scores(result: AttributionResult, metric: Metric) -> None:
    """Last guard before anything is ranked: every score finite."""
    scored = [*result.nodes_per_pair.items()]
    if result.edges_per_pair is not None:
        scored.append(("edges", result.edges_per_pair))
    for site, scores in scored:
        found = non_finite(scores)
        if found is not None:
            raise UserError(
                f"attribution scores at {site!r} are not finite ({found}) although metric "
                f"{describe_metric(metric)} and its gradient are: the activations there are "
                "(check the model's weights and inputs)."
            )


# -- scores ---------------------------------------------------------------------------


def _node_scores(
    runs: _Runs,
    result: AttributionResult,
    sites: Sequence[str],
    clean: Mapping[str, torch.Tensor],
    corrupt: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    batch: TokenBatch,
    metric_value: torch.Tensor,
) -> None:
    for site in sites:
        axes = runs.model.namespace.layout(site).split()
        before, after = clean[site], corrupt[site]
        if before.shape != after.shape:
            raise UserError(
                f"the clean activation at {site!r} has shape {tuple(before.shape)} but the corrupt "
                f"one {tuple(after.shape)}: a clean_cache from other prompts?"
            )
        dtype = torch.promote_types(after.dtype, torch.float32)
        product = (before.to(after.device, dtype) - after.to(dtype)) * grads[site].to(dtype)
        kept = [a for a in axes if a in _KEPT_AXES]
        reduced = (
            product.sum(dim=[i for i, a in enumerate(axes) if a not in _KEPT_AXES])
            if len(kept) < len(axes)
            else product
        )
        mask = runs.positions(site, batch).attention_mask().to(reduced.device, torch.float32)
        reduced = reduced * mask.reshape(
            [mask.shape[0] if a == "b" else mask.shape[1] if a in ("p", "q") else 1 for a in kept]
        )
        result.nodes_per_pair[site] = reduced
        result.nodes[site] = _combine(reduced, metric_value)
        result.node_axes[site] = " ".join(kept[1:])


def _combine(per_pair: torch.Tensor, metric_value: torch.Tensor) -> torch.Tensor:
    """Mean over pairs for a per-pair metric, sum for a scalar one."""
    return per_pair.mean(0) if metric_value.ndim == 1 else per_pair.sum(0)
