"""Hook names: the canonical vocabulary, other tools' aliases, and each model's namespace.

Everything here is plain data and string work (no torch), except ``HookPoint``, the
identity module that fires user hooks, which loads torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.hooks._hook_point import HookPoint as HookPoint
    from tl_core.hooks._model_info import ModelInfo as ModelInfo
    from tl_core.hooks._namespace import HookNamespace as HookNamespace
    from tl_core.hooks._order import forward_order as forward_order
    from tl_core.hooks._resolution import (
        HookResolution as HookResolution,
        canonical_name as canonical_name,
        layout_of as layout_of,
        resolve_hook_name as resolve_hook_name,
        suggest_names as suggest_names,
    )
    from tl_core.hooks._shapes import feature_shape as feature_shape
    from tl_core.hooks._vocabulary import (
        CANONICAL_TEMPLATES as CANONICAL_TEMPLATES,
        HookTemplate as HookTemplate,
        canonical_hook_names as canonical_hook_names,
    )

__getattr__, __dir__, __all__ = attach(__name__)
