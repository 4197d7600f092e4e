"""Load a config, a model and a tokenizer for the ``hf`` driver."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any, Final, cast

import torch
import transformers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForCTC,
    AutoModelForImageClassification,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    PretrainedConfig,
)

from tl_core import ConfigError, UserError
from tl_core.driver_api import HFTokenizer, Tokenizer, checked_model_folder
from tl_core.gguf import dequantized_gguf
from tl_driver_hf._architecture._built import built_class_name, describing_adapter
from tl_driver_hf._architecture._kinds import (
    lm_kind,
    refuse_other_kind,
    refuse_without_causal_lm,
    what_it_is,
)
from tl_driver_hf._options import BootOptions
from tl_driver_hf._weights._load_report import check_loading_info, held_load_report, release
from tl_driver_hf._weights._tokenizer import MissingTokenizer
from tl_driver_hf.adapters import ArchitectureAdapter, all_adapters

__all__ = [
    "adapter_for_config",
    "adapter_or_none",
    "built_class",
    "gguf_folder",
    "load_config",
    "load_model",
    "load_tokenizer",
    "wrap_tokenizer",
]


def gguf_folder(opts: BootOptions) -> BootOptions:
    """Options that boot a GGUF file from its dequantised folder (other options unchanged).

    The file is dequantised once into a cached safetensors folder
    (``tl_core.gguf.dequantized_gguf``) and booted like any folder: transformers
    otherwise parses the whole file again on every load, about a minute for SmolLM2-135M
    on two cores.
    """
    if opts.gguf_path is None:
        return opts
    folder = dequantized_gguf(
        opts.gguf_path,
        dtype=opts.dtype,
        auto_model=AutoModelForCausalLM,
        auto_tokenizer=AutoTokenizer,
        reason="transformers parses a GGUF file anew on every load",
    )
    return dataclasses.replace(opts, model_name=str(folder), gguf_path=None)


def load_config(opts: BootOptions) -> PretrainedConfig:
    """The model's config with ``hf_config_overrides`` and ``n_ctx`` applied.

    Raises:
        UserError: A folder that holds no checkpoint (empty, a sparse dictionary's, no
            ``config.json``), or a config transformers cannot read (``ConfigError``).
    """
    assert opts.model_name is not None
    is_folder = os.path.isdir(opts.model_name)
    if is_folder:
        checked_model_folder(opts.model_name, "model_name")
    where = "folder" if is_folder else "hub id"
    try:
        config = AutoConfig.from_pretrained(
            opts.model_name, revision=opts.revision, trust_remote_code=opts.trust_remote_code
        )
    except OSError as exc:
        raise UserError(f"cannot read the config of {where} {opts.model_name!r}: {exc}") from exc
    except ValueError as exc:  # config.json without a model_type, or with invalid fields
        raise ConfigError(
            f"cannot read the config of {where} {opts.model_name!r}: {str(exc).rstrip('.')}; "
            f"fix its config.json"
        ) from exc
    _check_overrides(config, opts.hf_config_overrides, opts.model_name)
    for key, value in opts.hf_config_overrides.items():
        setattr(config, key, value)
    return cast(PretrainedConfig, config)


# Config fields named like a size or count (num_hidden_layers, n_embd, head_dim, vocab_size,
# max_position_embeddings, ...): where the config holds a positive int, so must an override.
_SIZE_NAME = re.compile(r"^(num|n)_|_(size|dim|positions|embeddings)$")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_overrides(config: Any, overrides: Mapping[str, Any], model_name: str) -> None:
    """Refuse overrides that would be ignored or break the model, before any weight loads.

    Raises:
        ConfigError: A key the config does not have (with the closest field), or a size or
            count set to anything but a positive int.
    """
    model_type = getattr(config, "model_type", None)
    for key, value in overrides.items():
        if not hasattr(config, key) or callable(getattr(config, key)):
            fields = sorted({*config.to_dict(), *getattr(config, "attribute_map", {})})
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see its config.json for the fields"
            raise ConfigError(
                f"hf_config_overrides key {key!r} is not a field of the {model_type!r} config "
                f"of {model_name!r}, so setting it would change nothing; {hint}"
            )
        current = getattr(config, key)
        if _SIZE_NAME.search(key) and _positive_int(current) and not _positive_int(value):
            raise ConfigError(
                f"hf_config_overrides[{key!r}] = {value!r}, but {key!r} is a size or count of "
                f"the {model_type!r} config of {model_name!r} (now {current!r}); pass an int "
                f">= 1"
            )


def adapter_for_config(config: Any, built: str | None = None) -> ArchitectureAdapter:
    """The adapter of ``config``'s family.

    Args:
        config: The model's config.
        built: The name of the class transformers builds (``built_class_name``); the
            adapter must describe it. ``None``: the config's names decide.

    Raises:
        ConfigError: The architecture is not supported (lists the supported families).
    """
    model_type = getattr(config, "model_type", None)
    architectures = tuple(getattr(config, "architectures", None) or ())
    adapter = describing_adapter(model_type, architectures, built)
    if adapter is None:
        families = ", ".join(sorted({a.family for a in all_adapters()}))
        raise ConfigError(
            f"architecture {architectures[0] if architectures else model_type!r} "
            f"(model_type {model_type!r}) is not supported by the hf driver; supported "
            f"families: {families}. See tl_driver_hf.check_model_support and "
            f"docs/adding-a-family.md to add one."
        )
    problems = adapter.description.config_problems(config)
    if problems:
        raise ConfigError(
            f"this {adapter.family!r} checkpoint has a layout the hf driver does not serve: "
            + "; ".join(problems)
        )
    return adapter


def apply_n_ctx(config: PretrainedConfig, adapter: ArchitectureAdapter, n_ctx: int) -> None:
    """Write ``n_ctx`` to the field the family reads, warning past the trained length.

    Models with learned positions keep their config (their position table has a fixed
    size); the driver then refuses longer inputs itself.

    Raises:
        ConfigError: Larger than trained with learned positions (there are no weights for
            the extra positions).
    """
    trained = adapter.description.model_info(config).n_ctx
    if n_ctx > trained:
        if adapter.pos_embed is not None:
            raise ConfigError(
                f"n_ctx={n_ctx} exceeds the {trained} learned positions of this "
                f"{adapter.family!r} model; there are no position embeddings beyond that"
            )
        warnings.warn(
            f"n_ctx={n_ctx} is larger than the {trained} positions this model was trained "
            f"on; outputs past {trained} tokens may be poor",
            UserWarning,
            stacklevel=4,
        )
    if adapter.pos_embed is None:
        # Learned position tables keep their trained size (the checkpoint's rows); the
        # driver enforces the shorter limit itself.
        config.max_position_embeddings = n_ctx


_AUTO_CLASSES: Final = {
    "causal_lm": AutoModelForCausalLM,
    "masked_lm": AutoModelForMaskedLM,
    "vision_language": AutoModelForImageTextToText,
    "seq2seq": AutoModelForSeq2SeqLM,
    "image_classifier": AutoModelForImageClassification,
    "ctc": AutoModelForCTC,
}


def _model_class(opts: BootOptions, config: Any) -> Any:
    """The class ``from_pretrained`` is called on: ``model_class``, else the auto class of
    the config's kind (a masked LM's checkpoint builds its masked LM, ``lm_kind``)."""
    cls = opts.model_class
    if cls is None:
        return _AUTO_CLASSES[lm_kind(config)]
    if isinstance(cls, str):
        found = getattr(transformers, cls, None)
        if found is None:
            raise UserError(f"model_class={cls!r} is not a class in transformers")
        return found
    if not hasattr(cls, "from_pretrained"):
        raise UserError(f"model_class must be a transformers model class, got {cls!r}")
    return cls


def _n_devices_map(adapter: ArchitectureAdapter, config: Any, n: int) -> dict[str, int]:
    n_layers = adapter.description.model_info(config).n_layers
    placement: dict[str, int] = {adapter.embed: 0}
    if adapter.pos_embed:
        placement[adapter.pos_embed] = 0
    per = -(-n_layers // n)
    for i in range(n_layers):
        placement[f"{adapter.layers}.{i}"] = min(i // per, n - 1)
    if adapter.final_norm is not None:
        placement[adapter.final_norm] = n - 1
    tied = getattr(config, "tie_word_embeddings", False)
    placement[adapter.lm_head] = 0 if tied else n - 1
    prefix = adapter.layers.rsplit(".", 1)[0] + "." if "." in adapter.layers else ""
    # Anything else of the inner model (rotary tables) goes with the embedding.
    if prefix:
        placement.setdefault(prefix.rstrip("."), 0)
    return placement


def _experts_for(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Mixture-of-experts layers in float64 run transformers' per-expert loop: its default
    grouped matrix multiply takes float32 and half precision only (and fails at the forward)."""
    setter = getattr(model, "set_experts_implementation", None)
    if dtype != torch.float64 or not callable(setter):
        return
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        setter("eager")


def load_model(
    opts: BootOptions, config: PretrainedConfig, adapter: ArchitectureAdapter | None
) -> nn.Module:
    """Load (or, with ``load_weights=False``, build on the meta device) the model."""
    cls = _model_class(opts, config)
    if not opts.load_weights:
        with torch.device("meta"):
            auto = cls in _AUTO_CLASSES.values()
            build = cls.from_config if auto else cls._from_config
            return cast(nn.Module, build(config, dtype=opts.dtype, attn_implementation="eager"))
    kwargs: dict[str, Any] = {
        "config": config,
        "dtype": opts.dtype,
        "revision": opts.revision,
        "trust_remote_code": opts.trust_remote_code,
        "attn_implementation": "eager",
    }
    move_to = None
    if opts.device is not None:
        if importlib.util.find_spec("accelerate") is not None:
            kwargs["device_map"] = opts.device
        else:
            move_to = opts.device  # without accelerate: load on the CPU, then move
    elif opts.n_devices is not None and adapter is not None:
        kwargs["device_map"] = _n_devices_map(adapter, config, opts.n_devices)
    elif opts.device_map is not None:
        kwargs["device_map"] = opts.device_map
    if opts.offload_folder is not None:
        kwargs["offload_folder"] = opts.offload_folder
    if opts.max_memory is not None:
        kwargs["max_memory"] = dict(opts.max_memory)
    name = str(opts.model_name)
    with held_load_report() as report:
        try:
            # Sizes that disagree are reported (and refused below, naming the weights), not
            # raised by transformers with a pointer to its table.
            model, info = cls.from_pretrained(
                opts.model_name, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
            )
        except OSError as exc:
            raise UserError(_no_weights(name, exc)) from exc
        except ImportError as exc:
            raise UserError(f"cannot load {name!r}: {exc}") from exc
        except (
            AssertionError,
            AttributeError,
            KeyError,
            RuntimeError,
            TypeError,
            ValueError,
        ) as exc:
            # transformers' own refusal of this config for this class (a Reformer LM head
            # over an encoder's config): its message, as a tl error.
            raise ConfigError(
                f"transformers cannot build {built_name(config, cls)} from the config of "
                f"{name!r}{what_it_is(config)}: {type(exc).__name__}: {exc}"
            ) from exc
    check_loading_info(model, info, name=name, overrides=opts.hf_config_overrides, config=config)
    if opts.model_class is None:
        refuse_other_kind(model, config, name=name)
    release(report)
    if move_to is not None:
        model.to(move_to)
    _experts_for(model, opts.dtype)
    model.eval()
    return model  # type: ignore[no-any-return]


def built_name(config: Any, cls: Any) -> str:
    """The name of the class ``cls`` (an auto class: the class it picks) builds for ``config``."""
    if cls in _AUTO_CLASSES.values():
        from transformers.models.auto import modeling_auto

        mapping = {
            AutoModelForCausalLM: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            AutoModelForMaskedLM: "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            AutoModelForImageTextToText: "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            AutoModelForSeq2SeqLM: "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
        }[cls]
        names = getattr(modeling_auto, mapping)
        found = names.get(str(getattr(config, "model_type", "")))
        if found:
            return found if isinstance(found, str) else str(found[0])
    return str(getattr(cls, "__name__", cls))


def _no_weights(name: str, exc: OSError) -> str:
    """Why transformers found no weights to load, with what the folder holds instead."""
    if not os.path.isdir(name):
        return f"cannot load the weights of hub id {name!r}: {exc}"
    found = sorted(os.listdir(name))
    shown = ", ".join(found[:12]) + (f", ... ({len(found)} files)" if len(found) > 12 else "")
    return (
        f"folder {name!r} has a config.json but no weights transformers can load "
        f"(model.safetensors, model.safetensors.index.json with its shards, pytorch_model.bin "
        f"or pytorch_model.bin.index.json); it holds: {shown}. Copy the checkpoint's weights "
        f"into it, or (in Python) boot with load_weights=False to inspect the config alone "
        f"(transformers: {exc})"
    )


def wrap_tokenizer(tokenizer: Any) -> Tokenizer:
    """Wrap a transformers tokenizer (or pass through one that already is a tl Tokenizer)."""
    if isinstance(tokenizer, (HFTokenizer, MissingTokenizer)):
        return tokenizer
    if (
        hasattr(tokenizer, "encode")
        and hasattr(tokenizer, "decode")
        and hasattr(tokenizer, "convert_ids_to_tokens")
    ):
        return HFTokenizer(tokenizer)
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    raise UserError(
        f"tokenizer must be a transformers tokenizer, a tl Tokenizer or a name/folder to load "
        f"one from, got {type(tokenizer).__name__}"
    )


def load_tokenizer(
    source: Any,
    config: Any,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    local_only: bool = False,
    required: bool = False,
) -> Tokenizer:
    """The tokenizer from ``source`` (object, name or folder).

    Args:
        source: A tokenizer object, or a hub id / folder to load one from.
        config: The model config (its special token ids serve the stand-in).
        revision: Hub revision of the tokenizer files.
        trust_remote_code: Passed to ``AutoTokenizer``.
        local_only: Never reach the network.
        required: Raise when loading fails (the user named this tokenizer); otherwise a
            ``MissingTokenizer`` stands in, which still runs token ids.

    Raises:
        UserError: ``required`` and loading failed, or an object that is no tokenizer.
    """
    if source is not None and not isinstance(source, (str, os.PathLike)):
        return wrap_tokenizer(source)
    try:
        loaded = AutoTokenizer.from_pretrained(
            str(source),
            revision=revision,
            trust_remote_code=trust_remote_code,
            local_files_only=local_only,
        )
    except Exception as exc:
        if required:
            raise UserError(
                f"cannot load tokenizer {source!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return MissingTokenizer(config, f"loading one from {source!r} failed: {type(exc).__name__}")
    return HFTokenizer(loaded)


def built_class(config: Any, opts: BootOptions) -> str | None:
    """The name of the class ``load_model`` builds for ``config`` (see ``built_class_name``).

    Raises:
        ConfigError: ``architectures`` and ``model_type`` name different causal LMs, or
            transformers has no causal LM for the config's model type (a T5, a ViT).
        UserError: An unknown ``model_class``.
    """
    remote = opts.trust_remote_code and "AutoModelForCausalLM" in (
        getattr(config, "auto_map", None) or {}
    )
    if opts.model_class is None and not remote and lm_kind(config) == "causal_lm":
        refuse_without_causal_lm(config, name=str(opts.model_name))
    return built_class_name(
        config,
        _model_class(opts, config),
        trust_remote_code=opts.trust_remote_code,
        name=str(opts.model_name),
    )


def adapter_or_none(
    config: Any, opts: BootOptions, built: str | None = None
) -> ArchitectureAdapter | None:
    """The described family of ``config``, or ``None`` when its architecture is to be inferred.

    Args:
        config: The model's config.
        opts: The boot options.
        built: The name of the class transformers builds (or built) for it; the description
            follows that class, never a name the config merely carries.

    Raises:
        ConfigError: A described family with a layout it does not serve, or an architecture
            to infer with options inference cannot honour (no weights, ``certify=False``,
            ``n_devices``).
    """
    model_type = getattr(config, "model_type", None)
    architectures = tuple(getattr(config, "architectures", None) or ())
    try:
        return adapter_for_config(config, built)
    except ConfigError:
        if describing_adapter(model_type, architectures, built):
            raise  # a described family whose checkpoint it cannot serve: keep that reason
    what = built or (architectures or (model_type,))[0]
    if not opts.load_weights:
        raise ConfigError(
            f"architecture {what!r} has no hand-written description, and inferring one runs the "
            f"model, which load_weights=False cannot; boot with its weights"
        )
    if not opts.certify:
        raise UserError(
            f"certify=False turns certification off for described families only; {what!r} is "
            f"inferred from its modules, and tl never serves an inferred hook it has not certified"
        )
    if opts.n_devices is not None:
        raise ConfigError(
            f"n_devices splits the layers of described families only; {what!r} is inferred "
            f"from its modules after loading: use device_map instead"
        )
    return None
