"""Figures for interpretability results, thin over matplotlib; every function returns the figure.

Figures are built with ``matplotlib.figure.Figure`` (not pyplot), so nothing depends on a
display or a global backend: a script saves them with ``fig.savefig(...)``, a notebook
shows the returned figure once. Pass ``ax=`` to draw into an axes of your own figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from tl_core._errors import UserError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "PLOTS_EXTRA",
    "plot_head_scores",
    "plot_layer_sweep",
    "plot_logit_lens",
    "plot_patching",
    "plot_pattern",
]

#: What installs matplotlib for tl's plotting helpers.
PLOTS_EXTRA = "pip install 'tl-core[plots]'"

Array = Any  # a torch tensor, numpy array or nested sequence of numbers


def _matplotlib() -> Any:
    try:
        import matplotlib.figure
    except ImportError:
        raise UserError(
            f"plotting needs matplotlib, which is not installed; {PLOTS_EXTRA}"
        ) from None
    return matplotlib.figure


def _matrix(values: Array, what: str, ndim: int = 2) -> Any:
    tensor = torch.as_tensor(values.detach() if isinstance(values, torch.Tensor) else values)
    if tensor.ndim != ndim:
        raise UserError(f"{what} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise UserError(f"{what} is empty (shape {tuple(tensor.shape)}): nothing to plot")
    return tensor.float().cpu().numpy()


def _axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        # An axes may sit in a SubFigure; savefig and the callers only need the Figure API.
        return cast("Figure", ax.figure), ax
    figure = _matplotlib().Figure(figsize=size, layout="constrained")
    return figure, figure.add_subplot()


def _labels(labels: Sequence[str] | None, n: int, what: str) -> list[str] | None:
    if labels is None:
        return None
    out = [str(label) for label in labels]
    if len(out) != n:
        raise UserError(f"{what} has {len(out)} labels for {n} entries")
    return out


def _ticks(ax: Axes, axis: str, labels: list[str] | None, rotate: bool = False) -> None:
    if labels is None:
        return
    set_ticks = ax.set_xticks if axis == "x" else ax.set_yticks
    set_ticks(range(len(labels)), labels, rotation=90 if rotate else 0, fontsize=8)


def plot_pattern(
    pattern: Array,
    tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """One head's attention pattern as a heatmap: queries down, keys across.

    Args:
        pattern: ``[query_pos, key_pos]`` attention weights.
        tokens: One label per position (``model.to_str_tokens(...)``).
        title: Figure title.
        ax: Draw into this axes instead of a new figure.

    Returns:
        The figure.

    Raises:
        UserError: matplotlib is missing, or the shapes do not fit.
    """
    data = _matrix(pattern, "pattern")
    labels = _labels(tokens, data.shape[1], "tokens")
    # Fewer queries than keys (a pattern read during generation): the queries are the last.
    labels_q = labels[-data.shape[0] :] if labels is not None else None
    side = max(4.0, 0.22 * data.shape[1] + 2)
    figure, axes = _axes(ax, (side + 1, side))
    image = axes.imshow(data, cmap="Blues", vmin=0.0, vmax=max(1e-9, float(data.max())))
    _ticks(axes, "x", labels, rotate=True)
    _ticks(axes, "y", labels_q)
    axes.set_xlabel("key position")
    axes.set_ylabel("query position")
    if title:
        axes.set_title(title)
    figure.colorbar(image, ax=axes, shrink=0.8, label="attention")
    return figure


def plot_logit_lens(
    values: Array,
    layer_labels: Sequence[str] | None = None,
    tokens: Sequence[str] | None = None,
    *,
    cell_text: Sequence[Sequence[str]] | None = None,
    value_label: str = "probability",
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """A logit-lens heatmap: one row per residual point, one column per position.

    Args:
        values: ``[layer, pos]``, e.g. the probability of a token (or of the top token) read
            out through the unembedding at each residual point.
        layer_labels: One label per row (``cache.logit_lens(return_labels=True)``'s labels).
        tokens: One label per position.
        cell_text: ``[layer][pos]`` text drawn in each cell (the top token there).
        value_label: The colour bar's label.
        title: Figure title.
        ax: Draw into this axes instead of a new figure.

    Returns:
        The figure.

    Raises:
        UserError: matplotlib is missing, or the shapes do not fit.
    """
    data = _matrix(values, "values")
    rows = _labels(layer_labels, data.shape[0], "layer_labels")
    cols = _labels(tokens, data.shape[1], "tokens")
    if cell_text is not None and (
        len(cell_text) != data.shape[0] or any(len(r) != data.shape[1] for r in cell_text)
    ):
        raise UserError(f"cell_text must be {data.shape[0]} rows of {data.shape[1]} strings")
    width = max(5.0, 1.0 * data.shape[1] + 2.5)
    height = max(4.0, 0.28 * data.shape[0] + 1.5)
    figure, axes = _axes(ax, (width, height))
    image = axes.imshow(
        data, cmap="viridis", aspect="auto", vmin=0.0, vmax=max(1e-9, float(data.max()))
    )
    _ticks(axes, "x", cols, rotate=True)
    _ticks(axes, "y", rows)
    if cell_text is not None:
        high = 0.6 * float(data.max())
        for i, row in enumerate(cell_text):
            for j, text in enumerate(row):
                axes.text(
                    j,
                    i,
                    text,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="black" if data[i, j] > high else "white",
                )
    axes.set_xlabel("position")
    axes.set_ylabel("residual stream")
    if title:
        axes.set_title(title)
    figure.colorbar(image, ax=axes, shrink=0.8, label=value_label)
    return figure


def plot_patching(
    scores: Array,
    layer_labels: Sequence[str] | None = None,
    tokens: Sequence[str] | None = None,
    *,
    value_label: str = "share of the clean answer restored",
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """An activation-patching heatmap: one row per patched layer, one column per position.

    Args:
        scores: ``[layer, pos]`` metric after patching that site (0 = corrupted run,
            1 = clean run, for a normalised metric).
        layer_labels: One label per row (the patched hooks).
        tokens: One label per position.
        value_label: The colour bar's label.
        title: Figure title.
        ax: Draw into this axes instead of a new figure.

    Returns:
        The figure.

    Raises:
        UserError: matplotlib is missing, or the shapes do not fit.
    """
    data = _matrix(scores, "scores")
    rows = _labels(layer_labels, data.shape[0], "layer_labels")
    cols = _labels(tokens, data.shape[1], "tokens")
    bound = max(1.0, float(abs(data).max()))
    width = max(4.5, 0.8 * data.shape[1] + 2.5)
    height = max(4.0, 0.25 * data.shape[0] + 1.5)
    figure, axes = _axes(ax, (width, height))
    image = axes.imshow(data, cmap="RdBu", aspect="auto", vmin=-bound, vmax=bound)
    _ticks(axes, "x", cols, rotate=True)
    _ticks(axes, "y", rows)
    axes.set_xlabel("patched position")
    axes.set_ylabel("patched layer")
    if title:
        axes.set_title(title)
    figure.colorbar(image, ax=axes, shrink=0.8, label=value_label)
    return figure


def plot_layer_sweep(
    curves: dict[str, Array],
    *,
    x_label: str = "layer",
    y_label: str = "share of the clean answer restored",
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """One line per named curve over layers (a patching sweep, a probe's accuracy, ...).

    Args:
        curves: Label -> one value per layer.
        x_label: The x axis label.
        y_label: The y axis label.
        title: Figure title.
        ax: Draw into this axes instead of a new figure.

    Returns:
        The figure.

    Raises:
        UserError: matplotlib is missing, no curves, or a curve that is not 1-D.
    """
    if not curves:
        raise UserError("curves is empty: nothing to plot")
    figure, axes = _axes(ax, (7.0, 4.0))
    for label, values in curves.items():
        data = _matrix(values, f"curve {label!r}", ndim=1)
        axes.plot(range(len(data)), data, marker="o", markersize=3, label=label)
    axes.axhline(0.0, color="grey", linewidth=0.5)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    if title:
        axes.set_title(title)
    return figure


def plot_head_scores(
    scores: Array,
    *,
    value_label: str = "score",
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Per-head scores as a heatmap: one row per layer, one column per head.

    Args:
        scores: ``[layer, head]`` (induction scores, patching effects, ...).
        value_label: The colour bar's label.
        title: Figure title.
        ax: Draw into this axes instead of a new figure.

    Returns:
        The figure.

    Raises:
        UserError: matplotlib is missing, or ``scores`` is not 2-D.
    """
    data = _matrix(scores, "scores")
    figure, axes = _axes(
        ax, (max(4.0, 0.45 * data.shape[1] + 2), max(4.0, 0.22 * data.shape[0] + 1.5))
    )
    image = axes.imshow(data, cmap="magma", aspect="auto")
    axes.set_xticks(range(data.shape[1]))
    axes.set_yticks(range(data.shape[0]))
    axes.tick_params(labelsize=7)
    axes.set_xlabel("head")
    axes.set_ylabel("layer")
    if title:
        axes.set_title(title)
    figure.colorbar(image, ax=axes, shrink=0.8, label=value_label)
    return figure
