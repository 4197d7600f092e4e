"""``tl capture``: collect activations at scale into a resumable, shardable store on disk.

A store is a folder of safetensors shards and a ``manifest.json``; ``capture`` writes it
(continuing an interrupted run), ``merge_stores`` joins the parts of a sharded job,
``capture_on_ray`` runs those parts on a Ray cluster,
``CaptureStore`` reads it for training loops, ``export_sae_lens`` writes sae-lens's cached
activations format. See ``docs/capture.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.capture._config import CaptureConfig as CaptureConfig
    from tl_core.capture._export import (
        SaeLensExport as SaeLensExport,
        export_sae_lens as export_sae_lens,
    )
    from tl_core.capture._merge import merge_stores as merge_stores
    from tl_core.capture._on_ray import (
        ClusterSummary as ClusterSummary,
        capture_on_ray as capture_on_ray,
    )
    from tl_core.capture._reader import CaptureStore as CaptureStore, RowDataset as RowDataset
    from tl_core.capture._run import CaptureSummary as CaptureSummary, capture as capture

__getattr__, __dir__, __all__ = attach(__name__)
