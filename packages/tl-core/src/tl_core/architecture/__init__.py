"""What a model is, independent of any engine: the one source of truth every driver reads.

``FamilyDescription`` rows (one per hand-described family, ``all_families``) hold every
engine-independent fact of a family: its norms and where they sit, how its block combines
attention and the MLP, its position scheme, embedding, QK-norm, MLP variant, the config
fields that decide a fact per checkpoint, the configs it cannot describe and why. Its
methods are the derived rules, written once: ``model_info``, ``config_problems``,
``is_parallel``, ``sandwich``, ``block_form``, ``absent_templates``, ``architecture``. A
driver keeps only where its engine holds each module (the hf driver's
``ArchitectureAdapter``, the vllm driver's ``Layout``) and refers to the description;
architectures nobody described get an inferred description of the same class. ``Architecture``
is a description read against one checkpoint's config: what ``bridge.architecture`` holds.

A fact tl did not establish is ``UNKNOWN``, never a default. Importing this package needs
neither torch nor an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.architecture._config import model_info_from_config as model_info_from_config
    from tl_core.architecture._description import (
        Architecture as Architecture,
        AttentionDescription as AttentionDescription,
        MLPDescription as MLPDescription,
        NormDescription as NormDescription,
        StackDescription as StackDescription,
        VisionDescription as VisionDescription,
        block_form as block_form,
        describe_model as describe_model,
        uses_alibi as uses_alibi,
    )
    from tl_core.architecture._families import (
        all_families as all_families,
        family_description as family_description,
        family_named as family_named,
    )
    from tl_core.architecture._family import (
        BlockContents as BlockContents,
        FamilyDescription as FamilyDescription,
    )
    from tl_core.architecture._vocabulary import (
        NORM_KINDS as NORM_KINDS,
        UNKNOWN as UNKNOWN,
        AttentionDirection as AttentionDirection,
        AttentionVariant as AttentionVariant,
        BlockForm as BlockForm,
        MLPVariant as MLPVariant,
        ModelKind as ModelKind,
        NormKind as NormKind,
        PositionScheme as PositionScheme,
        QKNorm as QKNorm,
        Unknown as Unknown,
        normalization_type as normalization_type,
    )

__getattr__, __dir__, __all__ = attach(__name__)
