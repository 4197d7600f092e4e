"""Build, run and cache the tiny checkpoints of every kind of model the report scans.

A *kind* is one of transformers' task mappings (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_MASKED_LM_MAPPING_NAMES``, ...) with the auto class that builds its models and
the inputs they run on: token ids; token ids and decoder ids (sequence-to-sequence); token
ids with an image where the model takes one of its config's size (vision-language); random
pixels of the config's ``image_size`` and ``num_channels`` (image classification); random
audio samples or features of the config's ``feature_size`` / ``num_mel_bins`` (CTC). No
processor or tokenizer is downloaded: every input follows from the config.

``build(model_type, cache, kind)`` shrinks the model type's default config
(``_tiny_checkpoints.tiny_config``), builds the kind's class in float32 (seeded), runs it,
saves it with ``save_pretrained`` into ``cache/<model_type>`` (causal LMs) or
``cache/<kind>/<model_type>``, and checks that the kind's auto class loads it back with
the same logits; or records why transformers cannot. The folder's ``tiny.json`` holds the
outcome and the inputs; it is reused while this file and ``_tiny_checkpoints.py`` are
unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _tiny_checkpoints as tiny

__all__ = [
    "BUILDER_FINGERPRINT",
    "KINDS",
    "Built",
    "Kind",
    "build",
    "class_name",
    "kind",
    "model_types",
    "run",
    "tensors",
]

_HERE = Path(__file__).resolve().parent
#: Hash of the rules and of this file: a cached folder written by another version is rebuilt.
BUILDER_FINGERPRINT = hashlib.sha256(
    (_HERE / "_tiny_checkpoints.py").read_bytes() + Path(__file__).read_bytes()
).hexdigest()[:16]
MARKER = "tiny.json"
#: Decoder ids of a sequence-to-sequence batch: two prompts of five ids.
DECODER_LENGTH = 5
#: Raw audio samples per prompt (0.2 s at 16 kHz: a few frames after a wav2vec2 encoder's
#: 320-fold downsampling), and frames of features for models reading spectrograms.
AUDIO_SAMPLES = 3200
AUDIO_FRAMES = 32


@dataclass(frozen=True)
class Kind:
    """One mapping the report scans.

    Attributes:
        key: Short name, also the cache subfolder (``""`` for causal LMs: the folders the
            report always used).
        title: The page's section title.
        mapping: The transformers mapping of model types to classes.
        auto_class: The transformers auto class that builds and reloads them.
        inputs: ``"ids"``, ``"seq2seq"``, ``"image-text"``, ``"pixels"`` or ``"audio"``.
        causal_config: Whether BERT-like configs are made decoders (``is_decoder``).
    """

    key: str
    title: str
    mapping: str
    auto_class: str
    inputs: str
    causal_config: bool = False

    @property
    def takes_ids(self) -> bool:
        """Whether the kind's models read token ids (tl's hf driver can run them)."""
        return self.inputs in ("ids", "seq2seq", "image-text")


CAUSAL = Kind(
    "", "Causal LMs", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", "ids", True
)
KINDS: tuple[Kind, ...] = (
    CAUSAL,
    Kind(
        "masked-lm",
        "Masked LMs",
        "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
        "AutoModelForMaskedLM",
        "ids",
    ),
    Kind(
        "seq2seq",
        "Sequence-to-sequence LMs",
        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
        "AutoModelForSeq2SeqLM",
        "seq2seq",
    ),
    Kind(
        "image-text-to-text",
        "Vision-language models",
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
        "AutoModelForImageTextToText",
        "image-text",
    ),
    Kind(
        "image-classification",
        "Image classifiers",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForImageClassification",
        "pixels",
    ),
    Kind(
        "ctc", "Speech recognisers (CTC)", "MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC", "audio"
    ),
)


def kind(key: str) -> Kind:
    """The kind named ``key`` (``"causal"`` is the causal LMs' kind)."""
    for k in KINDS:
        if k.key == key or (key == "causal" and k is CAUSAL):
            return k
    raise KeyError(key)


def _mapping(k: Kind) -> Mapping[str, Any]:
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, k.mapping))


def model_types(k: Kind = CAUSAL) -> list[str]:
    """Every model type transformers maps in ``k``'s mapping, sorted."""
    return sorted(_mapping(k))


def class_name(model_type: str, k: Kind = CAUSAL) -> str:
    """The class ``k``'s mapping gives ``model_type`` (the first, where it lists several)."""
    name = _mapping(k)[model_type]
    return name if isinstance(name, str) else str(name[0])


# -- inputs -------------------------------------------------------------------------------
#
# A batch is recorded as JSON (``spec``): token ids as lists, float inputs by their shape
# (the values are seeded random numbers, the same on every run).


def _first(config: Any, *names: str) -> Any:
    subs = ("vision_config", "audio_config", "encoder_config")
    holders = [config, *(getattr(config, n, None) for n in subs)]
    for holder in holders:
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                return value
    return None


def _pixel_shape(config: Any, batch: int) -> list[int]:
    """``[batch, channels, height, width]`` from the config's ``image_size`` (224 where it
    names none: convolutional classifiers take any size) and ``num_channels``."""
    size = _first(config, "image_size") or 224
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))
    channels = _first(config, "num_channels", "in_channels") or 3
    return [batch, int(channels), int(height), int(width)]


def _parameters(model: Any) -> Mapping[str, Any]:
    return inspect.signature(model.forward).parameters


def _ids_spec(config: Any, k: Kind, model: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"input_ids": tiny.input_ids(config)}
    if k.inputs == "seq2seq" and "decoder_input_ids" in _parameters(model):
        spec["decoder_input_ids"] = [row[:DECODER_LENGTH] for row in tiny.input_ids(config, 1)]
    return spec


def _audio_specs(config: Any, model: Any) -> list[dict[str, Any]]:
    """The audio batches to try, in order: raw samples (a batch of waveforms, or of
    one-channel waveforms), or feature frames of the config's feature size."""
    batch = tiny.BATCH_SHAPE[0]
    if "input_values" in _parameters(model):
        return [
            {"input_values": [batch, AUDIO_SAMPLES]},
            {"input_values": [batch, 1, AUDIO_SAMPLES]},
        ]
    features = _first(config, "num_mel_bins", "feature_size", "input_feat_per_channel") or 80
    return [{"input_features": [batch, AUDIO_FRAMES, int(features)]}]


def tensors(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The input tensors of a recorded batch (float inputs seeded by their name)."""
    import torch

    out: dict[str, Any] = {}
    for n, (name, value) in enumerate(sorted(spec.items())):
        if name.endswith("_ids"):
            out[name] = torch.tensor(value)
        else:
            generator = torch.Generator().manual_seed(n)
            out[name] = torch.randn(value, generator=generator)
    return out


def run(model: Any, spec: Mapping[str, Any]) -> Any:
    """``model``'s plain forward on a recorded batch: no cache, every hidden state."""
    import torch

    inputs = tensors(spec)
    with torch.no_grad():
        try:
            return model(**inputs, use_cache=False, output_hidden_states=True)
        except TypeError as error:
            if "use_cache" not in str(error):
                raise
            return model(**inputs, output_hidden_states=True)


def _image_tokens(features: Any) -> int:
    for name in ("pooler_output", "last_hidden_state"):
        value = getattr(features, name, None)
        if value is not None:
            features = value
            break
    if isinstance(features, (list, tuple)):
        return sum(int(f.shape[:-1].numel()) for f in features)
    return int(features.shape[:-1].numel())


def _with_image(config: Any, model: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Token ids holding the image tokens of one image of the config's size, and the image;
    or why the model takes no such image (many need their processor's extra inputs)."""
    import torch

    token = _first(config, "image_token_id", "image_token_index")
    getter = getattr(model, "get_image_features", None)
    if not isinstance(token, int) or getter is None:
        return None, "no image token id or get_image_features"
    shape = _pixel_shape(config, 1)
    try:
        try:
            with torch.no_grad():
                n = _image_tokens(
                    getter(pixel_values=tensors({"pixel_values": shape})["pixel_values"])
                )
        except ValueError as error:
            # Idefics2/3 and SmolVLM take a list of images per prompt: [batch, n, c, h, w].
            if "unpack" not in str(error):
                raise
            shape = [1, *shape]
            with torch.no_grad():
                n = _image_tokens(
                    getter(pixel_values=tensors({"pixel_values": shape})["pixel_values"])
                )
        ids = tiny.input_ids(config)[0]
        spec = {"input_ids": [ids[:3] + [token] * n + ids[3:]], "pixel_values": shape}
        run(model, spec)
    except Exception as error:
        return None, tiny.describe(error, 120)
    return spec, None


# -- building -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    """What building one model type of one kind gave.

    Attributes:
        model_type: The transformers model type.
        class_name: The class the kind's mapping gives it.
        folder: The saved checkpoint, or ``None`` when transformers could not run it.
        error: Why not (the exception's type and message on one line), else ``None``.
        inputs: The batch it ran on (see ``tensors``).
        remark: What the page should say about the run (an image the model could not take).
        reused: Whether the folder came from the cache.
        kind: Its kind.
    """

    model_type: str
    class_name: str
    folder: Path | None
    error: str | None
    inputs: Mapping[str, Any] = field(default_factory=dict)
    remark: str = ""
    reused: bool = False
    kind: Kind = CAUSAL

    @property
    def ids(self) -> tuple[tuple[int, ...], ...]:
        """The token ids of the batch (empty for pixel and audio models)."""
        return tuple(tuple(row) for row in self.inputs.get("input_ids", ()))


def _spec(config: Any, k: Kind, model: Any) -> tuple[dict[str, Any], str]:
    if k.inputs == "pixels":
        return {"pixel_values": _pixel_shape(config, tiny.BATCH_SHAPE[0])}, ""
    if k.inputs == "audio":
        specs = _audio_specs(config, model)
        for spec in specs[:-1]:
            with contextlib.suppress(Exception):
                run(model, spec)
                return spec, ""
        return specs[-1], ""
    if k.inputs == "image-text":
        spec, why = _with_image(config, model)
        if spec is not None:
            return spec, "ran with an image of the config's size"
        return _ids_spec(config, k, model), f"ran on token ids only (an image: {why})"
    return _ids_spec(config, k, model), ""


def _image_token_in_vocabulary(config: Any) -> None:
    """Move an image token id the tiny vocabulary cut off (LLaVA's 32000) inside it, on an
    id no other special token holds: an image cannot reach a token the embedding lacks."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    taken = {
        v
        for holder in (config, text)
        for k, v in vars(holder).items()
        if isinstance(v, int) and (k.endswith("_token_id") or k.endswith("_token_index"))
    }
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            free = next(i for i in range(vocab - 1, 0, -1) if i not in taken)
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, name, free)
                taken.add(free)


def _try_build(model_type: str, folder: Path, k: Kind) -> tuple[str | None, dict[str, Any], str]:
    import torch
    import transformers

    auto = getattr(transformers, k.auto_class)
    spec: dict[str, Any] = {}
    remark = ""
    try:
        with tiny.quiet():
            config = tiny.tiny_config(model_type, causal=k.causal_config)
            if k.inputs == "image-text":
                _image_token_in_vocabulary(config)
            if not isinstance(_mapping(k)[model_type], str):
                # The auto class picks among several classes by the config's architectures.
                config.architectures = [class_name(model_type, k)]
            torch.manual_seed(0)
            model: Any = auto.from_config(config, dtype=torch.float32)
            model.eval()
            tiny.perturb_constants(model, seed=1)
            spec, remark = _spec(config, k, model)
            out = run(model, spec)
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor):
            return "the forward returned no logits", spec, remark
        if not bool(torch.isfinite(logits).all()):
            return "the logits are not finite", spec, remark
        if folder.exists():
            shutil.rmtree(folder)
        with tiny.quiet():
            model.save_pretrained(folder)
    except Exception as error:  # any failure of transformers itself is the verdict
        return tiny.describe(error), spec, remark
    try:
        with tiny.quiet():
            reloaded: Any = auto.from_pretrained(folder, dtype=torch.float32)
            again = run(reloaded.eval(), spec).logits
    except Exception as error:
        return f"the saved checkpoint does not load back: {tiny.describe(error)}", spec, remark
    diff = float((again - logits).abs().max())
    if not diff <= 1e-5 * max(1.0, float(logits.abs().max())):
        return (
            f"the saved checkpoint loads back with other logits (max abs diff {diff:.3g})",
            spec,
            remark,
        )
    return None, spec, remark


def folder_of(model_type: str, cache: Path, k: Kind = CAUSAL) -> Path:
    """Where the tiny checkpoint of ``model_type`` of kind ``k`` lives in ``cache``."""
    return cache / k.key / model_type if k.key else cache / model_type


def build(
    model_type: str,
    cache: Path,
    k: Kind = CAUSAL,
    *,
    time_limit_s: float = 120.0,
    rebuild: bool = False,
) -> Built:
    """Build, run and save the tiny ``model_type`` of kind ``k`` under ``cache`` (or reuse it).

    Never raises for the model: a failure is recorded in ``Built.error`` and in the
    folder's ``tiny.json``, so a rerun reuses the verdict too.
    """
    folder = folder_of(model_type, cache, k)
    marker = folder / MARKER
    name = class_name(model_type, k)
    if marker.exists() and not rebuild:
        try:
            saved = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = {}
        if saved.get("builder") == BUILDER_FINGERPRINT:
            return Built(
                model_type,
                name,
                folder if saved["error"] is None else None,
                saved["error"],
                saved["inputs"],
                saved.get("remark", ""),
                reused=True,
                kind=k,
            )
    try:
        with tiny.time_limit(time_limit_s):
            error, spec, remark = _try_build(model_type, folder, k)
    except tiny.TimeLimitError as timeout:
        error, spec, remark = tiny.describe(timeout), {}, ""
    if error is not None and folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "builder": BUILDER_FINGERPRINT,
        "model_type": model_type,
        "class": name,
        "error": error,
        "inputs": spec,
        "remark": remark,
    }
    marker.write_text(json.dumps(record, indent=1), encoding="utf-8")
    return Built(model_type, name, folder if error is None else None, error, spec, remark, kind=k)
