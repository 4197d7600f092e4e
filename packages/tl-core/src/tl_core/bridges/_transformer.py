"""``TransformerBridge``: the researcher-facing ``nn.Module`` over a local driver."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tl_core._errors import UnsupportedFeatureError
from tl_core.bridges._base import Bridge
from tl_core.driver_api._capabilities import SplitQKVDriver, WeightFoldingDriver
from tl_core.driver_api._local import LocalDriver
from tl_core.driver_api._request import ForwardRequest, ForwardResult
from tl_core.hooks._hook_point import HookPoint

__all__ = ["TransformerBridge"]


class TransformerBridge(Bridge, nn.Module):
    """A model with named hook points, gradients and the TransformerLens-style API.

    Build one with ``TransformerBridge.boot_native(config)``,
    ``TransformerBridge.boot_transformers(model_name, ...)`` or ``tl_core.boot(...)``.
    Every hook name argument accepts canonical names and aliases. Forward hooks run live
    and may edit values; backward hooks see gradients. On one hook, Python hooks attached
    to the bridge (in attach order) run before ``intervene`` specs, and the specs before
    ``intervene`` callables; captures see the value after all of them.
    """

    kind = "local"

    def __init__(self, driver: LocalDriver) -> None:
        nn.Module.__init__(self)
        self._adopt(driver)
        #: The driver's ``nn.Module`` (the HF or native model itself), for weights and gradients.
        self.model = driver.module

    # -- construction -----------------------------------------------------------------

    @classmethod
    def boot_native(cls, config: Any = None, **overrides: Any) -> TransformerBridge:
        """A small random transformer in plain torch (see ``tl_core.native.NativeConfig``).

        Args:
            config: A ``NativeConfig``, a dict of TransformerLens-style keys, a preset name
                (``"gpt2"`` or ``"llama"``), or ``None`` for the GPT-2-style default.
            **overrides: Config fields to change.
        """
        return cls.boot(config, driver="native", **overrides)

    @classmethod
    def boot_transformers(cls, model_name: Any = None, **options: Any) -> TransformerBridge:
        """A HuggingFace transformers model (needs ``pip install tl-driver-hf``).

        Args:
            model_name: A hub id, a local folder, or a GGUF file (``"model.gguf"``, or a
                folder plus ``gguf_file=``; extra ``tl-driver-hf[gguf]``), e.g.
                ``tl_core.models.smollm2_gguf()``.
            **options: The hf driver's boot options (``dtype``, ``device``, ...; see
                ``tl_driver_hf.HFDriver.boot``).
        """
        return cls.boot(model_name, driver="hf", **options)

    # -- facts ------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where the model takes its inputs (its embedding's device)."""
        return self.driver.device  # type: ignore[no-any-return]

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Canonical hook name -> HookPoint."""
        return dict(self.driver.hook_points)

    def __getattr__(self, name: str) -> Any:
        # Weight accessors (W_Q, W_U, ...) and sub-modules (blocks, embed) live on the
        # driver's module; reach them through the bridge as TransformerLens users expect.
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self._modules.get("model")
            if model is not None and not name.startswith("_"):
                return getattr(model, name)
            raise

    # -- running ----------------------------------------------------------------------

    def _execute(self, request: ForwardRequest) -> ForwardResult:
        return self.driver.run(request)  # type: ignore[no-any-return]

    def set_use_split_qkv_input(self, enabled: bool) -> TransformerBridge:
        """Give each attention head its own copy of the block input (``attn.hook_q_input``,
        ``hook_k_input``, ``hook_v_input``), as HookedTransformer's ``use_split_qkv_input``;
        a gradient there is that head's alone. ``False`` turns it off.

        Raises:
            UnsupportedFeatureError: If the driver has no per-head inputs.
        """
        if not isinstance(self.driver, SplitQKVDriver):
            raise UnsupportedFeatureError(f"driver {self._name!r} has no per-head q/k/v inputs")
        self.driver.set_use_split_qkv_input(enabled)
        return self

    # -- weights ----------------------------------------------------------------------

    def enable_compatibility_mode(self, **options: Any) -> TransformerBridge:
        """Fold norms and centre weights so activations match HookedTransformer's.

        Raises:
            UnsupportedFeatureError: If the driver cannot rewrite its weights.
        """
        if not isinstance(self.driver, WeightFoldingDriver):
            raise UnsupportedFeatureError(
                f"driver {self._name!r} does not support enable_compatibility_mode()"
            )
        self.driver.enable_compatibility_mode(**options)
        return self
