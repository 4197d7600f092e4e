"""What kind of model a transformers class is: which the hf driver builds, which it refuses.

The hf driver serves decoder-only causal LMs, masked LMs (encoders with a head that
predicts each position's token: BERT, RoBERTa, ...), vision-language models (a causal
language stack that reads images through a vision tower: LLaVA, Gemma 3, ...),
encoder-decoders (T5, BART, ...), and image classifiers and CTC speech recognisers that run
one stack of blocks (ViT, DeiT, wav2vec2, HuBERT). A checkpoint of another kind (a
speech-to-text model, an audio classifier) is refused, and the refusal names the kind by
the task mapping transformers files the class under.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from tl_core import ConfigError

__all__ = [
    "SERVED_KINDS",
    "LMKind",
    "class_kind",
    "is_causal_lm_class",
    "lm_kind",
    "refuse_other_kind",
    "refuse_without_causal_lm",
    "what_it_is",
    "with_article",
]

#: The kind of a masked LM's class, as ``_KINDS`` names it.
MASKED_LM = "masked language model"
#: The kind of a vision-language model's class, as ``_KINDS`` names it.
VISION_LANGUAGE = "vision-language model"
#: The kind of an encoder-decoder's class, as ``_KINDS`` names it.
SEQ2SEQ = "sequence-to-sequence model"
#: The kinds of models that read pixels or audio, as ``_KINDS`` names them.
IMAGE_CLASSIFIER = "image classifier"
CTC = "CTC speech recogniser"
#: The kinds besides causal LMs that the hf driver builds whole (``lm_kind``).
SERVED_KINDS: frozenset[str] = frozenset(
    {MASKED_LM, VISION_LANGUAGE, SEQ2SEQ, IMAGE_CLASSIFIER, CTC}
)
#: What the hf driver serves, for refusals.
SERVED_TEXT = (
    "decoder-only causal LMs, masked LMs, vision-language models, encoder-decoders, image "
    "classifiers and CTC speech recognisers"
)

#: transformers' task mappings, most specific first (BART's ``ForConditionalGeneration``
#: is filed under both sequence-to-sequence and masked LM), with what their classes are.
_KINDS: tuple[tuple[str, str, str], ...] = (
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "a", SEQ2SEQ),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "a", "speech-to-text model"),
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "a", "vision-language model"),
    ("MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "a", "multimodal model"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "a", "masked language model"),
    ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "a", "model with pretraining heads"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "an", IMAGE_CLASSIFIER),
    ("MODEL_FOR_CTC_MAPPING_NAMES", "a", CTC),
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


@cache
def _kind_by_type() -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    found: dict[str, str] = {}
    for mapping, _, kind in _KINDS:
        for model_type in getattr(modeling_auto, mapping, {}):
            found.setdefault(model_type, kind)
    return found


def _checkpoint_kind(config: Any) -> tuple[str | None, str]:
    """What the config says its checkpoint is, and the name that says it."""
    architectures = [str(a) for a in getattr(config, "architectures", None) or ()]
    for name in architectures:
        kind = class_kind(name)
        if kind is not None:
            return kind, name
    model_type = str(getattr(config, "model_type", None))
    return _kind_by_type().get(model_type), f"model_type {model_type!r}"


LMKind = Literal["causal_lm", "masked_lm", "vision_language", "seq2seq", "image_classifier", "ctc"]

_BY_KIND: dict[str, LMKind] = {
    MASKED_LM: "masked_lm",
    VISION_LANGUAGE: "vision_language",
    SEQ2SEQ: "seq2seq",
    IMAGE_CLASSIFIER: "image_classifier",
    CTC: "ctc",
}


def lm_kind(config: Any) -> LMKind:
    """Which kind of language model the hf driver builds for ``config``.

    A masked LM where the config's first architecture is a masked-LM class (a
    ``BertForMaskedLM`` checkpoint, though transformers also maps ``bert`` to the causal
    ``BertLMHeadModel``), or where it names none and transformers maps the model type to a
    masked LM only (``distilbert``); a vision-language model likewise (a
    ``LlavaForConditionalGeneration`` checkpoint); otherwise a causal LM (which
    ``refuse_without_causal_lm`` refuses for the other kinds). A vision-language class that
    transformers also maps as a causal LM (``Gemma3ForConditionalGeneration``) is a causal
    LM here: ``AutoModelForCausalLM`` builds it whole.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # class_kind and _kind_by_type name a kind only where no earlier (more specific)
    # mapping lists the class or type.
    architectures = [str(a) for a in getattr(config, "architectures", None) or ()]
    if architectures:
        return _BY_KIND.get(class_kind(architectures[0]) or "", "causal_lm")
    model_type = str(getattr(config, "model_type", None))
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return _BY_KIND.get(_kind_by_type().get(model_type) or "", "causal_lm")
    return "causal_lm"


def refuse_without_causal_lm(config: Any, *, name: str) -> None:
    """Refuse, before any weight loads, a config transformers maps to no causal-LM class.

    Raises:
        ConfigError: ``AutoModelForCausalLM`` cannot build the config's model type (a T5,
            a ViT, a Wav2Vec2): what the checkpoint is, and that the kind is not served.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = str(getattr(config, "model_type", None))
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    kind, named = _checkpoint_kind(config)
    what = f"{with_article(kind)} ({named})" if kind else f"a {named} checkpoint"
    served = f"{kind}s are not served yet" if kind else "it serves no model that is not a causal LM"
    raise ConfigError(
        f"the checkpoint {name!r} is {what}: transformers has no causal-LM class for model "
        f"type {model_type!r} (AutoModelForCausalLM cannot build it), and the hf driver "
        f"serves {SERVED_TEXT}; {served}."
    )


def refuse_other_kind(model: Any, config: Any, *, name: str) -> None:
    """Refuse a causal LM transformers built from the config of a checkpoint of another kind.

    ``AutoModelForCausalLM`` builds ``BertLMHeadModel`` from a ``BertForMaskedLM``
    checkpoint: every weight finds its place, but the model is the masked LM's encoder read
    as a decoder. ``Qwen3_5ForCausalLM`` reads the language model of a
    ``Qwen3_5ForConditionalGeneration`` checkpoint, and transformers declares its vision
    tower never loaded. A config whose ``architectures`` name a base model (``LlamaModel``)
    is no other kind: its causal LM is that model with its tied unembedding.

    Args:
        model: The model transformers built.
        config: The checkpoint's config (the model's may be its text part only).
        name: The checkpoint, for the message.

    Raises:
        ConfigError: The config's ``architectures`` name a class of another kind than the
            causal LM that was built (both named, with that the kind is not served).
    """
    built = type(model).__name__
    architectures = [str(a) for a in getattr(config, "architectures", None) or ()]
    if not architectures or built in architectures:
        return
    other = architectures[0]
    kind = class_kind(other)
    if kind is None or kind == "base model without a head":
        return
    raise ConfigError(
        f"the checkpoint {name!r} is {with_article(kind)}: its config's architectures name "
        f"{other}, and transformers builds {built} from it, a causal LM the checkpoint was "
        f"not written for (another model over its weights, or a part of them). The hf "
        f"driver serves {SERVED_TEXT}; {kind}s are not served yet."
    )


def what_it_is(config: Any) -> str:
    """`` (its config's architectures name X, a masked language model)`` for a config of
    another kind than a causal LM, else ``""``."""
    kind, named = _checkpoint_kind(config)
    if kind is None or kind == "base model without a head":
        return ""
    source = "model type" if named.startswith("model_type") else "architectures name"
    shown = named.removeprefix("model_type ") if source == "model type" else named
    return f" (its config's {source} {shown}: {with_article(kind)})"
