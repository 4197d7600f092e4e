"""tl-core: one hook vocabulary, activation cache and intervention language for every engine.

Importing ``tl_core`` is cheap: names load on first use, so driver discovery and the
``tl`` command do not pay for torch until a model is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tl_core._version import __version__

if TYPE_CHECKING:
    from tl_core._affine import (
        AffineEdit as AffineEdit,
        compile_plan as compile_plan,
        compile_specs as compile_specs,
    )
    from tl_core._aliases import (
        HookResolution as HookResolution,
        canonical_name as canonical_name,
        resolve_hook_name as resolve_hook_name,
        suggest_names as suggest_names,
    )
    from tl_core._boot import (
        boot as boot,
    )
    from tl_core._bridge import (
        TransformerBridge as TransformerBridge,
    )
    from tl_core._cache import (
        ActivationCache as ActivationCache,
    )
    from tl_core._discovery import (
        DriverEntry as DriverEntry,
        EngineRequirement as EngineRequirement,
        InstalledDriver as InstalledDriver,
        available_drivers as available_drivers,
        clear_driver_cache as clear_driver_cache,
        get_driver_entry as get_driver_entry,
        load_driver_class as load_driver_class,
    )
    from tl_core._driver import (
        FEATURES as FEATURES,
        Driver as Driver,
        ForwardResult as ForwardResult,
        validate_driver as validate_driver,
    )
    from tl_core._errors import (
        ConfigError as ConfigError,
        DriverContractError as DriverContractError,
        DriverLoadError as DriverLoadError,
        DriverNotFoundError as DriverNotFoundError,
        EngineVersionError as EngineVersionError,
        HookNameError as HookNameError,
        RemoteHookMutationError as RemoteHookMutationError,
        SpecError as SpecError,
        TLError as TLError,
        UnsupportedFeatureError as UnsupportedFeatureError,
        UserError as UserError,
    )
    from tl_core._hook_point import (
        HookPoint as HookPoint,
    )
    from tl_core._local_driver import (
        LocalDriver as LocalDriver,
    )
    from tl_core._model_info import (
        ModelInfo as ModelInfo,
    )
    from tl_core._plan import (
        InterventionPlan as InterventionPlan,
        build_plan as build_plan,
    )
    from tl_core._readout import (
        ModelReadout as ModelReadout,
    )
    from tl_core._remote_bridge import (
        RemoteBridge as RemoteBridge,
    )
    from tl_core._specs import (
        SPEC_JSON_SCHEMA as SPEC_JSON_SCHEMA,
        InterventionSpec as InterventionSpec,
        parse_spec as parse_spec,
    )
    from tl_core._tokenizer import (
        ByteTokenizer as ByteTokenizer,
        Tokenizer as Tokenizer,
    )
    from tl_core._vocabulary import (
        CANONICAL_TEMPLATES as CANONICAL_TEMPLATES,
        HookTemplate as HookTemplate,
        canonical_hook_names as canonical_hook_names,
        layout_of as layout_of,
    )

_EXPORTS: dict[str, str] = {
    "AffineEdit": "_affine",
    "compile_plan": "_affine",
    "compile_specs": "_affine",
    "HookResolution": "_aliases",
    "canonical_name": "_aliases",
    "resolve_hook_name": "_aliases",
    "suggest_names": "_aliases",
    "boot": "_boot",
    "TransformerBridge": "_bridge",
    "ActivationCache": "_cache",
    "DriverEntry": "_discovery",
    "EngineRequirement": "_discovery",
    "InstalledDriver": "_discovery",
    "available_drivers": "_discovery",
    "clear_driver_cache": "_discovery",
    "get_driver_entry": "_discovery",
    "load_driver_class": "_discovery",
    "FEATURES": "_driver",
    "Driver": "_driver",
    "ForwardResult": "_driver",
    "validate_driver": "_driver",
    "ConfigError": "_errors",
    "DriverContractError": "_errors",
    "DriverLoadError": "_errors",
    "DriverNotFoundError": "_errors",
    "EngineVersionError": "_errors",
    "HookNameError": "_errors",
    "RemoteHookMutationError": "_errors",
    "SpecError": "_errors",
    "TLError": "_errors",
    "UnsupportedFeatureError": "_errors",
    "UserError": "_errors",
    "HookPoint": "_hook_point",
    "LocalDriver": "_local_driver",
    "ModelInfo": "_model_info",
    "ModelReadout": "_readout",
    "RemoteBridge": "_remote_bridge",
    "SPEC_JSON_SCHEMA": "_specs",
    "InterventionPlan": "_plan",
    "InterventionSpec": "_specs",
    "build_plan": "_plan",
    "parse_spec": "_specs",
    "ByteTokenizer": "_tokenizer",
    "Tokenizer": "_tokenizer",
    "CANONICAL_TEMPLATES": "_vocabulary",
    "HookTemplate": "_vocabulary",
    "canonical_hook_names": "_vocabulary",
    "layout_of": "_vocabulary",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tl_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tl_core.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
