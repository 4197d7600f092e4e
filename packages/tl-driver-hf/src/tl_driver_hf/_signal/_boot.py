"""Booting a checkpoint of a model that reads pixels or audio: the whole model, certified."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from tl_core import ConfigError
from tl_driver_hf._options import BootOptions
from tl_driver_hf._runtime._whole_model import refuse_unserved_options
from tl_driver_hf._signal._certify import certify_signal
from tl_driver_hf._signal._driver import SignalDriver
from tl_driver_hf._signal._layout import SIGNAL_KEYS, SignalReads
from tl_driver_hf._weights._loading import load_model

__all__ = ["SIGNAL_KINDS", "boot_signal", "signal_reads"]


#: The ``lm_kind`` of models that read pixels or audio.
SIGNAL_KINDS = frozenset({"image_classifier", "ctc"})


def signal_reads(model: Any) -> SignalReads | None:
    """What a loaded model reads instead of tokens, if it reads none: ``"pixels"``
    (``pixel_values``), ``"audio samples"`` (``input_values``) or ``"audio features"``
    (``input_features``)."""
    forward = getattr(model, "forward", None)
    if not isinstance(model, nn.Module) or forward is None:
        return None
    params = inspect.signature(forward).parameters
    if "input_ids" in params:
        return None
    for key, reads in SIGNAL_KEYS.items():
        if key in params:
            return reads
    return None


def boot_signal(
    opts: BootOptions, config: Any = None, model: nn.Module | None = None, name: str = ""
) -> SignalDriver:
    """The driver of an image classifier or CTC checkpoint (or of a loaded ``model``),
    certified.

    Raises:
        UserError: Options not served on such models.
        ConfigError: Weights that do not fit, an input tl cannot give, no one stack of
            blocks, or a run that does not reproduce the model.
    """
    refuse_unserved_options(
        opts, "models that read pixels or audio", tokenizer=opts.tokenizer is not None
    )
    if model is None:
        model = load_model(opts, config, None)
        name = str(opts.model_name)
    reads = signal_reads(model)
    if reads is None:
        raise ConfigError(
            f"{type(model).__name__} reads none of {', '.join(SIGNAL_KEYS)}: tl cannot give "
            "it its input"
        )
    driver = SignalDriver(model, reads, name=name)
    driver.set_certification(certify_signal(driver, name=name or type(model).__name__))
    return driver
