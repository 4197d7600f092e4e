"""Which class transformers builds for a config: the one source of the description.

``AutoModelForCausalLM`` picks its class by the config's ``model_type``; ``architectures`` is
a label it does not read (vLLM reads it instead). A config whose two fields disagree (a
Gemma name on Llama weights) would otherwise be described as one family and run as the
other, so the hf driver describes the class transformers builds, and refuses a config whose
``architectures`` names another causal LM, since engines would disagree on what it is.
"""

from __future__ import annotations

from typing import Any

from tl_core import ConfigError
from tl_driver_hf.adapters import ArchitectureAdapter, find_adapter

__all__ = ["built_class_name", "describing_adapter"]


def _causal_classes() -> set[str]:
    """Every causal-LM class name transformers maps a config to."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {
        name
        for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        for name in ((names,) if isinstance(names, str) else names)
    }


def _own_model_type(class_name: str) -> str:
    """The model type of a transformers class's own config (several types share a class)."""
    import transformers

    cls = getattr(transformers, class_name, None)
    return str(getattr(getattr(cls, "config_class", None), "model_type", None) or "?")


def built_class_name(
    config: Any, model_class: Any, *, trust_remote_code: bool, name: str
) -> str | None:
    """The name of the class ``from_pretrained`` builds for ``config``.

    Args:
        config: The checkpoint's config.
        model_class: The class the caller chose (``None``: ``AutoModelForCausalLM``), or
            the auto class of the config's kind (``AutoModelForMaskedLM``,
            ``AutoModelForImageTextToText``).
        trust_remote_code: Whether the checkpoint's own code may run (its class is then
            unknown until loaded).
        name: The checkpoint, for the message.

    Returns:
        The class name, or ``None`` when it cannot be known before loading (remote code,
        a config transformers maps to no causal LM).

    Raises:
        ConfigError: ``architectures`` names a causal LM other than the one ``model_type``
            builds (both named, with how to make them agree).
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForMaskedLM,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        MODEL_FOR_MASKED_LM_MAPPING,
    )

    by_kind = {
        AutoModelForMaskedLM: MODEL_FOR_MASKED_LM_MAPPING,
        AutoModelForImageTextToText: MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    }
    if model_class in by_kind:
        try:
            found_other: Any = by_kind[model_class][type(config)]
        except (KeyError, ValueError):
            return None
        first = found_other[0] if isinstance(found_other, (list, tuple)) else found_other
        return str(first.__name__)
    if model_class is not None and model_class is not AutoModelForCausalLM:
        return str(model_class.__name__)
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return None
    try:
        found: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None
    architectures = list(getattr(config, "architectures", None) or ())
    if isinstance(found, (list, tuple)):
        # As AutoModelForCausalLM chooses among several classes of one config.
        by_name = {cls.__name__: cls for cls in found}
        found = next((by_name[a] for a in architectures if a in by_name), found[0])
    built = str(found.__name__)
    named = [a for a in architectures if a in _causal_classes()]
    if named and built not in architectures:
        model_type = getattr(config, "model_type", None)
        own = _own_model_type(named[0])
        raise ConfigError(
            f"the config of {name!r} contradicts itself: its architectures {architectures} "
            f"name {named[0]!r} (model_type {own!r}), but its model_type "
            f"{model_type!r} makes transformers build {built!r}, so the weights would run as "
            f"one model while engines that read architectures (vLLM) build the other. Make "
            f"config.json agree: architectures [{built!r}] to run these weights as "
            f"{model_type!r}, or model_type {own!r} to run them as {named[0]!r}"
        )
    return built


def describing_adapter(
    model_type: str | None, architectures: tuple[str, ...], built: str | None
) -> ArchitectureAdapter | None:
    """The adapter describing the class transformers builds (``built``), or ``None``.

    Without ``built`` (remote code) the config's names decide, as ``find_adapter`` does. With
    it, an adapter listing the class, else one keyed by ``model_type`` alone that names no
    classes (a ``register_adapter`` family), never one describing another class.
    """
    if built is None:
        return find_adapter(model_type, architectures)
    adapter = find_adapter(None, (built,))
    if adapter is not None:
        return adapter
    by_type = find_adapter(model_type, ())
    return by_type if by_type is not None and not by_type.architectures else None
