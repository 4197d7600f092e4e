"""Plotting helpers (``pip install 'tl-core[plots]'`` for matplotlib), each returning its figure.

The cache draws its own tensors: ``cache.plot_pattern(layer, head)`` and
``cache.plot_logit_lens(token)``. The functions here take plain arrays, for results
computed in your own code (a patching sweep, per-head scores)::

    from tl_core.plots import plot_head_scores, plot_patching

    plot_head_scores(induction_scores, title="induction score").savefig("heads.png")

Importing this package is cheap; matplotlib loads when a figure is first drawn, and a
missing matplotlib is a ``UserError`` that names the extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.plots._figures import (
        PLOTS_EXTRA as PLOTS_EXTRA,
        plot_head_scores as plot_head_scores,
        plot_layer_sweep as plot_layer_sweep,
        plot_logit_lens as plot_logit_lens,
        plot_patching as plot_patching,
        plot_pattern as plot_pattern,
    )

__getattr__, __dir__, __all__ = attach(__name__)
