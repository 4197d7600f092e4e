"""Stopping a transformers forward partway, and the plumbing around a run of the hf driver.

A torch hook that raises ``Stop`` ends the forward where the caller asked (``stop_at_layer``,
or a probe of a layer's call), carrying what reached that point.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PretrainedConfig

from tl_driver_hf._runtime._torch_hooks import _input_of

__all__ = ["Stop", "configs_of", "prober", "stop_after", "stopper"]


class Stop(Exception):
    """Ends a forward early, carrying the residual stream that reached the stop."""

    def __init__(self, value: Any = None, args: Any = None, kwargs: Any = None) -> None:
        super().__init__()
        self.value, self.call_args, self.call_kwargs = value, args, kwargs


def stopper(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward pre-hook ending the run with the module's input."""
    raise Stop(_input_of(args, kwargs))


def stop_after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """A forward hook ending the run with the module's output."""
    raise Stop(output[0] if isinstance(output, tuple) else output)


def prober(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward pre-hook ending the run with the module's call arguments."""
    raise Stop(None, args, kwargs)


def configs_of(model: nn.Module) -> list[PretrainedConfig]:
    """Every distinct config object the model's modules read their attention choice from."""
    found: dict[int, PretrainedConfig] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            found.setdefault(id(config), config)
            for key in getattr(config, "sub_configs", {}) or {}:
                sub = getattr(config, key, None)
                if isinstance(sub, PretrainedConfig):
                    found.setdefault(id(sub), sub)
    return list(found.values())
