"""Intervention specs: the one schema, the validator that turns ``intervene=`` into a plan,
and the compilation of a plan to affine edits ``x * scale + bias``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.specs._affine import (
        AffineEdit as AffineEdit,
        compile_plan as compile_plan,
        compile_specs as compile_specs,
    )
    from tl_core.specs._plan import InterventionPlan as InterventionPlan, build_plan as build_plan
    from tl_core.specs._specs import (
        SPEC_JSON_SCHEMA as SPEC_JSON_SCHEMA,
        InterventionSpec as InterventionSpec,
        absolute_positions as absolute_positions,
        parse_spec as parse_spec,
    )

__getattr__, __dir__, __all__ = attach(__name__)
