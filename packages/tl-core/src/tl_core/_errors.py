"""The error hierarchy: one base class, and ``UserError`` for misuse."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DriverContractError",
    "DriverLoadError",
    "DriverNotFoundError",
    "EngineVersionError",
    "HookNameError",
    "ModelNotInstalledError",
    "RemoteHookMutationError",
    "SpecError",
    "TLError",
    "UnsupportedFeatureError",
    "UserError",
]


class TLError(Exception):
    """Base class of every error tl raises on purpose."""


class UserError(TLError, ValueError):
    """The caller asked for something that cannot work; the message says how to fix it."""


class HookNameError(UserError):
    """A hook name that no vocabulary entry or driver knows."""


class SpecError(UserError):
    """An intervention spec that fails validation."""


class ModelNotInstalledError(UserError):
    """A bundled model's package is not installed; the message gives the install command."""


class ConfigError(UserError):
    """A model or driver configuration that is invalid."""


class UnsupportedFeatureError(UserError):
    """The driver cannot do what was asked (no gradients, no sequence logits, ...)."""


class RemoteHookMutationError(UserError):
    """A Python hook tried to change a value that a remote engine already computed."""


class DriverNotFoundError(UserError):
    """No installed distribution provides the requested driver."""


class DriverLoadError(TLError):
    """A driver is installed but could not be loaded."""


class EngineVersionError(DriverLoadError):
    """The engine a driver wraps is installed in a version outside the supported range."""


class DriverContractError(TLError):
    """A driver object does not satisfy the Driver protocol."""
