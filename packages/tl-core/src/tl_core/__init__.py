"""tl-core: one hook vocabulary, activation cache and intervention language for every engine.

This namespace is the researcher API: boot a bridge, run and cache, intervene with specs,
look hook names up. Packages that add an engine use ``tl_core.driver_api``.

Importing ``tl_core`` is cheap: names load on first use, so driver discovery and the
``tl`` command do not pay for torch until a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach
from tl_core._version import __version__

if TYPE_CHECKING:
    from tl_core._errors import (
        ConfigError as ConfigError,
        DriverContractError as DriverContractError,
        DriverLoadError as DriverLoadError,
        DriverNotFoundError as DriverNotFoundError,
        EngineVersionError as EngineVersionError,
        HookNameError as HookNameError,
        ModelNotInstalledError as ModelNotInstalledError,
        RemoteHookMutationError as RemoteHookMutationError,
        SpecError as SpecError,
        TLError as TLError,
        UnsupportedFeatureError as UnsupportedFeatureError,
        UserError as UserError,
    )
    from tl_core.architecture._description import Architecture as Architecture
    from tl_core.bridges._boot import boot as boot
    from tl_core.bridges._remote import RemoteBridge as RemoteBridge
    from tl_core.bridges._transformer import TransformerBridge as TransformerBridge
    from tl_core.cache._cache import ActivationCache as ActivationCache
    from tl_core.certification._report import Certification as Certification
    from tl_core.driver_api._discovery import available_drivers as available_drivers
    from tl_core.hooks._hook_point import HookPoint as HookPoint
    from tl_core.hooks._model_info import ModelInfo as ModelInfo
    from tl_core.hooks._resolution import (
        HookResolution as HookResolution,
        canonical_name as canonical_name,
        layout_of as layout_of,
        resolve_hook_name as resolve_hook_name,
        suggest_names as suggest_names,
    )
    from tl_core.hooks._vocabulary import (
        CANONICAL_TEMPLATES as CANONICAL_TEMPLATES,
        HookTemplate as HookTemplate,
        canonical_hook_names as canonical_hook_names,
    )
    from tl_core.specs._specs import (
        SPEC_JSON_SCHEMA as SPEC_JSON_SCHEMA,
        InterventionSpec as InterventionSpec,
        parse_spec as parse_spec,
    )


__getattr__, __dir__, _names = attach(__name__)
__all__ = ["__version__", *_names]
