"""What kind of model a transformers class is, for refusals that say what a checkpoint is.

The hf driver serves decoder-only causal LMs. A checkpoint of another kind (a
sequence-to-sequence model, an encoder, a vision-language model) is refused, and the
refusal names the kind by the task mapping transformers files the class under.
"""

from __future__ import annotations

from functools import cache

__all__ = ["class_kind", "is_causal_lm_class", "with_article"]

#: transformers' task mappings, most specific first (BART's ``ForConditionalGeneration``
#: is filed under both sequence-to-sequence and masked LM), with what their classes are.
_KINDS: tuple[tuple[str, str, str], ...] = (
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "a", "sequence-to-sequence model"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "a", "speech-to-text model"),
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "a", "vision-language model"),
    ("MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "a", "multimodal model"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "a", "masked language model"),
    ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "a", "model with pretraining heads"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "an", "image classifier"),
    ("MODEL_FOR_CTC_MAPPING_NAMES", "a", "CTC speech recogniser"),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "an", "audio classifier"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "a", "sequence classifier"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "a", "token classifier"),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "a", "question-answering model"),
    ("MODEL_MAPPING_NAMES", "a", "base model without a head"),
)


def _names(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    return ()


@cache
def _kind_by_class() -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    found: dict[str, str] = {}
    for mapping, _, kind in _KINDS:
        for value in getattr(modeling_auto, mapping, {}).values():
            for name in _names(value):
                found.setdefault(name, kind)
    return found


@cache
def _causal_classes() -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in _names(v))


def is_causal_lm_class(class_name: str) -> bool:
    """Whether transformers maps some model type to ``class_name`` as its causal LM."""
    return class_name in _causal_classes()


def class_kind(class_name: str) -> str | None:
    """What a transformers class is (``"sequence-to-sequence model"``), by the first task
    mapping of ``_KINDS`` that lists it; ``None`` for a causal LM or a class none lists."""
    if is_causal_lm_class(class_name):
        return None
    return _kind_by_class().get(class_name)


def with_article(kind: str) -> str:
    """``kind`` with its article: ``"an image classifier"``."""
    article = next((a for _, a, k in _KINDS if k == kind), "a")
    return f"{article} {kind}"
