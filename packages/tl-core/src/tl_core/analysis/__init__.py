"""Gradient-based circuit analysis on any bridge with gradients (native, hf).

* ``attribution_patch``: attribution patching of nodes (every site, per position and head)
  and edges (writer -> reader pairs of the residual stream) in one forward-backward pass.
* ``use_relevance_rules``: LRP-style relevance rules (LN, Identity, Half, attention) swapped
  into the backward pass while the forward stays bit-identical.
* ``backward_lens``: the rank-one gradient factors of dense MLP weights and their
  vocabulary projection.

See ``docs/analysis.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.analysis._attribution import (
        AttributionResult as AttributionResult,
        attribution_patch as attribution_patch,
    )
    from tl_core.analysis._backward_lens import (
        BackwardLensResult as BackwardLensResult,
        WeightSite as WeightSite,
        backward_lens as backward_lens,
    )
    from tl_core.analysis._metrics import (
        logit_diff as logit_diff,
        logit_diff_metric as logit_diff_metric,
    )
    from tl_core.analysis._relevance import (
        RelevanceCoverage as RelevanceCoverage,
        RelevanceRules as RelevanceRules,
        use_relevance_rules as use_relevance_rules,
    )

__getattr__, __dir__, __all__ = attach(__name__)
