"""``NativeDriver``: the ``LocalDriver`` over ``NativeTransformer``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tl_core._errors import ConfigError
from tl_core.cache._readout import ModelReadout
from tl_core.driver_api._local import LocalDriver
from tl_core.driver_api._tokenizers import ByteTokenizer, Tokenizer
from tl_core.hooks._hook_point import HookPoint
from tl_core.hooks._model_info import ModelInfo
from tl_core.native._config import NativeConfig
from tl_core.native._model import NativeTransformer

__all__ = ["NativeDriver"]


class NativeDriver(LocalDriver):
    """Runs a ``NativeTransformer`` with the built-in byte-level tokenizer."""

    name = "native"

    def __init__(self, model: NativeTransformer, tokenizer: Tokenizer | None = None) -> None:
        self._model = model
        self._tokenizer = tokenizer or ByteTokenizer()
        self._split_qkv_input = model.cfg.use_split_qkv_input

    @classmethod
    def boot(
        cls,
        config: NativeConfig | Mapping[str, Any] | str | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **overrides: Any,
    ) -> NativeDriver:
        """Build a seeded random model.

        Args:
            config: A ``NativeConfig``, a dict with TransformerLens-style keys, a preset
                (``"gpt2"``, ``"llama"``) or ``None`` (the GPT-2-style default).
            device: Where the model lives.
            dtype: Parameter dtype (default float32).
            **overrides: Config fields that replace the config's values.

        Raises:
            ConfigError: Unknown keys or invalid values, naming the key; a ``dtype`` that
                is not a floating-point ``torch.dtype``, or one in which ``eps`` rounds to
                0 or overflows.
        """
        cfg = _config(config, overrides)
        if dtype is not None:
            _check_dtype(dtype, cfg.eps)
        model = NativeTransformer(cfg)
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
        return cls(model)

    @property
    def module(self) -> nn.Module:
        """The ``NativeTransformer``."""
        return self._model

    @property
    def hook_points(self) -> Mapping[str, HookPoint]:
        """Canonical name -> HookPoint of every site the model fires."""
        return self._served(self._model.all_hook_points)

    def _apply_split_qkv_input(self, enabled: bool) -> None:
        self._model.set_use_split_qkv_input(enabled)

    @property
    def info(self) -> ModelInfo:
        """The model's sizes and structure, its activation (``cfg.act_fn``) included."""
        info = self._model.info
        return info if info.act_fn is not None else replace(info, act_fn=self._model.cfg.act_fn)

    @property
    def tokenizer(self) -> Tokenizer:
        """The byte-level tokenizer."""
        return self._tokenizer

    def readout(self) -> ModelReadout:
        """Final norm and unembedding weights."""
        return self._model.readout()

    def run_model(
        self,
        input_ids: torch.Tensor | None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward of the native model (ids and block indices checked by the request)."""
        return self._model.run_blocks(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            start=start_at_layer,
            stop=stop_at_layer,
            residual=residual,
        )


def _config(
    config: NativeConfig | Mapping[str, Any] | str | None, overrides: Mapping[str, Any]
) -> NativeConfig:
    if isinstance(config, str):
        return NativeConfig.preset(config, **overrides)
    if config is None:
        return NativeConfig.gpt2_style(**overrides)
    if isinstance(config, NativeConfig):
        return NativeConfig.coerce({**config.to_dict(), **overrides}) if overrides else config
    if isinstance(config, Mapping):
        return NativeConfig.coerce({**config, **overrides})
    raise ConfigError(
        f"native config must be a NativeConfig, a dict or a preset name, got {type(config).__name__}"
    )


def _check_dtype(dtype: object, eps: float) -> None:
    """Refuse a non-float ``dtype``, and an ``eps`` the norms would hold as 0 or inf in it."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(
            "native boot option dtype must be a floating-point torch.dtype (torch.float32, "
            f"torch.bfloat16, torch.float16 or torch.float64), got {dtype!r}."
        )
    info = torch.finfo(dtype)
    allowed = f"choose eps from {info.tiny * info.eps:.8g} to {info.max:.8g}, or another dtype"
    held = float(torch.tensor(eps, dtype=dtype))
    if held == 0:
        raise ConfigError(
            f"native boot option 'eps' ({eps!r}) rounds to 0 in {dtype}, so a norm of an "
            f"all-zero vector would divide 0 by 0; {allowed}."
        )
    if math.isinf(held):
        raise ConfigError(
            f"native boot option 'eps' ({eps!r}) overflows {dtype}, which would zero every "
            f"norm's output; {allowed}."
        )
