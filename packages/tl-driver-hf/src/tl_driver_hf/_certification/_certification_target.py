"""What certification reads of a booted driver: ``CertifiableDriver``.

The certification modules name this Protocol instead of ``HFDriver``, so they need nothing of
the driver's module and the driver can import them without an import circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from tl_core import HookPoint, ModelInfo
from tl_core.architecture import Architecture
from tl_core.certification import Certification
from tl_driver_hf._runtime._model import HFHookedModel
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["CertifiableDriver"]


class CertifiableDriver(Protocol):
    """A booted hf driver as its certification sees it (``HFDriver`` is one)."""

    @property
    def hooked_model(self) -> HFHookedModel:
        """The hook points and the model's parts."""

    @property
    def hf_model(self) -> nn.Module:
        """The transformers model."""

    @property
    def adapter(self) -> ArchitectureAdapter:
        """The family's description and module paths."""

    @property
    def architecture(self) -> Architecture:
        """The engine-independent description."""

    @property
    def info(self) -> ModelInfo:
        """The model's sizes and facts."""

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""

    @property
    def hook_points(self) -> Mapping[str, HookPoint]:
        """Every hook served."""

    @property
    def absent_reasons(self) -> Mapping[str, str]:
        """Hooks not served, each with why."""

    @property
    def read_only_reasons(self) -> Mapping[str, str]:
        """Hooks served for reading only, each with why."""

    def run_model(
        self,
        input_ids: torch.Tensor | None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        residual: torch.Tensor | None = None,
        images: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward with the attached hooks."""

    def certify(self, *, thorough: bool = True) -> Certification:
        """The certification report of the served hooks."""

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's final logit soft-capping (identity without one)."""
