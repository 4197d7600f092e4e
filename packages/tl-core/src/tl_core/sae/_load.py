"""Loading sparse dictionaries: from sae-lens's folder format, or from a sae-lens ``SAE``.

A folder is read as sae-lens 6.54 reads it (``SAE.load_from_disk``): a ``cfg.json`` saved
before sae-lens 6 (no ``sae_lens_version``, or an older one) gets sae-lens's defaults for
that format (the architecture ``"standard"``, or ``"topk"`` from ``activation_fn``), and the
weights must be exactly the tensors of the architecture, no more and no fewer. Everything
sae-lens would refuse, tl refuses too, naming the file and what to change.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from tl_core._dictionaries._dictionary import ARCHITECTURES, NORMALIZATIONS, SparseDictionary
from tl_core._errors import ConfigError, UnsupportedFeatureError, UserError

__all__ = ["from_sae_lens", "load_dictionary"]

_CFG, _WEIGHTS = "cfg.json", "sae_weights.safetensors"


#: sae-lens's transcoder architectures -> the rule their features follow.
_TRANSCODERS = {
    "transcoder": "standard",
    "skip_transcoder": "standard",
    "jumprelu_transcoder": "jumprelu",
    "jumprelu_skip_transcoder": "jumprelu",
}

#: sae-lens architectures tl does not run, and why.
_UNSUPPORTED = {
    "gated": "its features use a gate and a magnitude path (b_gate, b_mag, r_mag)",
    "matching_pursuit": "it encodes by iterative matching pursuit, not by one encoder",
    "abstopk": "it keeps the k largest activations by absolute value, signed",
    "temporal": "it reads a sequence context, not one position",
    "batchtopk": "a batch-TopK dictionary runs at inference as jumprelu "
    "(sae-lens converts it when it saves one for inference)",
    "matryoshka_batchtopk": "a batch-TopK dictionary runs at inference as jumprelu "
    "(sae-lens converts it when it saves one for inference)",
}

_BASE = ("W_enc", "b_enc", "W_dec", "b_dec")


def _sae_lens_major(cfg: dict[str, Any]) -> int | None:
    """The major version of the sae-lens that saved ``cfg`` (``None``: not recorded)."""
    metadata = cfg.get("metadata")
    version = cfg.get("sae_lens_version") or (
        metadata.get("sae_lens_version") if isinstance(metadata, dict) else None
    )
    match = re.match(r"\s*(\d+)", str(version)) if version else None
    return int(match.group(1)) if match else None


def _pre_6(cfg: dict[str, Any]) -> dict[str, Any]:
    """A cfg saved before sae-lens 6, with the names and defaults sae-lens 6.54 gives it
    (its ``handle_pre_6_0_config``)."""
    renamed = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index"}
    new = {renamed.get(k, k): v for k, v in cfg.items()}
    if "activation_fn_str" in new:
        new["activation_fn"] = new.pop("activation_fn_str")
    new.setdefault("architecture", "standard")
    hook = new.get("hook_name")
    new.setdefault("reshape_activations", "hook_z" if "hook_z" in str(hook or "") else "none")
    kwargs = new.get("activation_fn_kwargs")
    if (
        new.get("activation_fn") == "topk"
        and isinstance(kwargs, dict)
        and kwargs.get("k") is not None
    ):
        new["architecture"], new["k"] = "topk", kwargs["k"]
    normalization = new.get("normalize_activations")
    if isinstance(normalization, bool) or normalization is None:
        new["normalize_activations"] = "expected_average_only_in" if normalization else "none"
    metadata = new.get("metadata")
    if not isinstance(metadata, dict):
        metadata = {}
    for key in ("hook_name", "hook_head_index"):
        if key in new and key not in metadata:
            metadata[key] = new[key]
    new["metadata"] = metadata
    return new


def _settings(cfg: object, where: str) -> dict[str, Any]:
    """The ``SparseDictionary`` settings of a sae-lens config, read as sae-lens reads it."""
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"{where}: the config is a JSON {type(cfg).__name__}, not an object of settings "
            f'(sae-lens\'s {_CFG} holds {{"architecture": ..., "d_in": ..., ...}})'
        )
    major = _sae_lens_major(cfg)
    if major is None or major < 6:
        cfg = _pre_6(cfg)
    elif "architecture" not in cfg:
        raise ConfigError(
            f"{where}: the config was saved by sae-lens {major}.x but names no architecture "
            '(sae-lens refuses it too); add "architecture": "standard", "jumprelu", '
            '"topk" or a transcoder\'s'
        )
    given = cfg["architecture"]
    if given in _UNSUPPORTED:
        raise UnsupportedFeatureError(
            f"{where}: architecture {given!r} is not supported by tl: {_UNSUPPORTED[given]}; tl "
            f"runs {', '.join(ARCHITECTURES)} and the transcoders {', '.join(_TRANSCODERS)}"
        )
    transcoder = given in _TRANSCODERS
    architecture = _TRANSCODERS.get(given, given)
    if architecture not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: architecture {given!r} is not one tl runs ({', '.join(ARCHITECTURES)}, "
            f"and the transcoders {', '.join(_TRANSCODERS)})"
        )
    normalization = cfg.get("normalize_activations", "none")
    if normalization == "expected_average_only_in":
        normalization = "none"  # sae-lens applies no runtime normalisation for it at inference
    if normalization not in NORMALIZATIONS:
        raise ConfigError(
            f"{where}: normalize_activations {normalization!r} is not one tl runs ({', '.join(NORMALIZATIONS)}); "
            "fold it into the weights first"
        )
    reshape = cfg.get("reshape_activations", "none")
    if reshape not in ("none", "hook_z"):
        raise ConfigError(
            f"{where}: reshape_activations {reshape!r} is not one tl runs ('none', 'hook_z')"
        )
    metadata = cfg.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ConfigError(f"{where}: metadata is a {type(metadata).__name__}, not an object")
    return {
        "architecture": architecture,
        # sae-lens keeps k for topk only (its other configs have no such field).
        "k": cfg.get("k") if architecture == "topk" else None,
        "rescale_acts_by_decoder_norm": architecture == "topk"
        and bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        "apply_b_dec_to_input": bool(cfg.get("apply_b_dec_to_input", not transcoder)),
        "normalize_activations": normalization,
        "hook_name": metadata.get("hook_name") or cfg.get("hook_name"),
        "output_hook_name": metadata.get("hook_name_out") or cfg.get("hook_name_out"),
        "flatten_heads": reshape == "hook_z",
        "transcoder": transcoder,
        "hook_head_index": metadata.get("hook_head_index", cfg.get("hook_head_index")),
        "_given": given,
    }


def _tensors_of(
    weights: dict[str, torch.Tensor], settings: dict[str, Any], where: str
) -> dict[str, torch.Tensor]:
    """The architecture's tensors from ``weights``, refusing missing and extra ones (sae-lens
    loads its state dict strictly), after sae-lens's two conversions of older files."""
    weights = dict(weights)
    given = settings["_given"]
    jump = settings["architecture"] == "jumprelu"
    if jump and "log_threshold" in weights and "threshold" not in weights:
        weights["threshold"] = torch.exp(weights.pop("log_threshold"))  # older sae-lens files
    scaling = weights.get("scaling_factor")
    if scaling is not None and bool(torch.all(scaling == 1)):
        del weights["scaling_factor"]  # sae-lens drops an all-ones scaling factor
    wanted = [*_BASE, *(["threshold"] if jump else []), *(["W_skip"] if "skip" in given else [])]
    missing = [k for k in wanted if k not in weights]
    extra = sorted(set(weights) - set(wanted))
    if missing or extra:
        parts = [f"lacks {', '.join(missing)}" if missing else ""]
        parts.append(f"holds {', '.join(extra)}, which it does not use" if extra else "")
        raise ConfigError(
            f"{where}: a {given!r} dictionary has the tensors {', '.join(wanted)}, but the file "
            f"{' and '.join(p for p in parts if p)} (sae-lens refuses it too); check the "
            "config's architecture, or save the dictionary again"
        )
    return {k: weights[k] for k in wanted}


def _check_sizes(
    cfg: dict[str, Any], tensors: dict[str, torch.Tensor], settings: dict[str, Any], where: str
) -> None:
    """Refuse ``d_in``/``d_sae``/``d_out`` in the config that the weights contradict, and
    an autoencoder whose decoder writes another width than it reads."""
    W_enc, W_dec = tensors["W_enc"], tensors["W_dec"]
    if W_enc.dim() != 2 or W_dec.dim() != 2:
        return  # SparseDictionary names the shapes
    if not settings["transcoder"] and W_dec.shape[1] != W_enc.shape[0]:
        raise ConfigError(
            f"{where}: a {settings['_given']!r} dictionary writes the width it reads, but W_enc "
            f"is {tuple(W_enc.shape)} and W_dec {tuple(W_dec.shape)} (sae-lens refuses it too); "
            "a transcoder's config names a transcoder architecture"
        )
    actual = {"d_in": W_enc.shape[0], "d_sae": W_enc.shape[1], "d_out": W_dec.shape[1]}
    wrong = [
        f"{key}={cfg[key]!r} but the weights have {actual[key]}"
        for key in actual
        if key in cfg and cfg[key] != actual[key]
    ]
    if wrong:
        raise ConfigError(
            f"{where}: the config's sizes disagree with the weights ({'; '.join(wrong)}; W_enc is "
            f"{tuple(W_enc.shape)}, W_dec {tuple(W_dec.shape)}); sae-lens refuses such a folder "
            "too: fix the config or the weights"
        )


def _build(
    tensors: dict[str, torch.Tensor], settings: dict[str, Any], where: str
) -> SparseDictionary:
    chosen = {k: v for k, v in settings.items() if not k.startswith("_")}
    try:
        return SparseDictionary(
            W_enc=tensors["W_enc"], b_enc=tensors["b_enc"], W_dec=tensors["W_dec"],
            b_dec=tensors["b_dec"], threshold=tensors.get("threshold"), W_skip=tensors.get("W_skip"),
            **chosen,
        )  # fmt: skip
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _read_cfg(path: Path) -> object:
    file = path / _CFG
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): "
            "a truncated or hand-edited file? Save the dictionary again (sae-lens's SAE.save_model)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{file} cannot be read: {exc}") from None


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"{file} is not a readable safetensors file ({exc}): a truncated or damaged "
            "download? Fetch or save the dictionary again"
        ) from None


def load_dictionary(folder: str | Path) -> SparseDictionary:
    """A dictionary saved by sae-lens (``SAE.save_model``): ``cfg.json`` and
    ``sae_weights.safetensors`` in ``folder``. sae-lens need not be installed.

    Raises:
        UserError: The folder or one of its two files is missing or unreadable.
        ConfigError: A file that is not valid JSON or safetensors; a config tl cannot read
            (an unknown normalisation, sizes that the weights contradict, no architecture
            in a sae-lens 6 config); weights missing or extra for the architecture, or
            holding NaN, infinite or integer values (each named with the file).
        UnsupportedFeatureError: A sae-lens architecture tl does not run (``gated``, ...).
    """
    path = Path(folder).expanduser()
    for name in (_CFG, _WEIGHTS):
        if not (path / name).is_file():
            raise UserError(
                f"{path} has no {name}: a sae-lens dictionary folder holds {_CFG} and {_WEIGHTS}"
            )
    raw = _read_cfg(path)
    settings = _settings(raw, str(path / _CFG))
    assert isinstance(raw, dict)
    weights_file = str(path / _WEIGHTS)
    tensors = _tensors_of(_read_weights(path / _WEIGHTS), settings, weights_file)
    _check_sizes(raw, tensors, settings, str(path / _CFG))
    return _build(tensors, settings, weights_file)


def from_sae_lens(sae: Any) -> SparseDictionary:
    """The dictionary of a sae-lens ``SAE`` object (its tensors are shared, not copied).

    Raises:
        UnsupportedFeatureError, ConfigError: As ``load_dictionary``, naming the SAE's class.
    """
    cfg = sae.cfg.to_dict() if hasattr(sae.cfg, "to_dict") else dict(vars(sae.cfg))
    where = type(sae).__name__
    settings = _settings(cfg, where)
    state = {k: v.detach() for k, v in sae.state_dict().items()}
    return _build(_tensors_of(state, settings, where), settings, where)
