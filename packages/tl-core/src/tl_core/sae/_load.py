"""Loading sparse dictionaries: from sae-lens's folder format, or from a sae-lens ``SAE``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tl_core._errors import ConfigError, UserError
from tl_core.sae._dictionary import ARCHITECTURES, NORMALIZATIONS, SparseDictionary

__all__ = ["from_sae_lens", "load_dictionary"]

_CFG, _WEIGHTS = "cfg.json", "sae_weights.safetensors"


#: sae-lens's transcoder architectures -> the rule their features follow.
_TRANSCODERS = {
    "transcoder": "standard",
    "skip_transcoder": "standard",
    "jumprelu_transcoder": "jumprelu",
    "jumprelu_skip_transcoder": "jumprelu",
}


def _settings(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    architecture = cfg.get("architecture", "standard")
    transcoder = architecture in _TRANSCODERS
    architecture = _TRANSCODERS.get(architecture, architecture)
    if architecture not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: architecture {architecture!r} is not one tl runs ({', '.join(ARCHITECTURES)}, "
            f"and the transcoders {', '.join(_TRANSCODERS)}); "
            "a batchtopk dictionary runs at inference as jumprelu (sae-lens converts it when it saves one "
            "for inference)"
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
    return {
        "architecture": architecture,
        "k": cfg.get("k"),
        "rescale_acts_by_decoder_norm": bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        "apply_b_dec_to_input": bool(cfg.get("apply_b_dec_to_input", not transcoder)),
        "normalize_activations": normalization,
        "hook_name": metadata.get("hook_name") or cfg.get("hook_name"),
        "output_hook_name": metadata.get("hook_name_out") or cfg.get("hook_name_out"),
        "flatten_heads": reshape == "hook_z",
        "transcoder": transcoder,
    }


def load_dictionary(folder: str | Path) -> SparseDictionary:
    """A dictionary saved by sae-lens (``SAE.save_model``): ``cfg.json`` and
    ``sae_weights.safetensors`` in ``folder``. sae-lens need not be installed.

    Raises:
        UserError: The folder or one of its two files is missing.
        ConfigError: The config names an architecture or normalisation tl does not run, or the
            weights do not fit it (each named).
    """
    path = Path(folder).expanduser()
    for name in (_CFG, _WEIGHTS):
        if not (path / name).is_file():
            raise UserError(
                f"{path} has no {name}: a sae-lens dictionary folder holds {_CFG} and {_WEIGHTS}"
            )
    from safetensors.torch import load_file

    cfg = json.loads((path / _CFG).read_text())
    weights = load_file(str(path / _WEIGHTS))
    missing = [k for k in ("W_enc", "b_enc", "W_dec", "b_dec") if k not in weights]
    if missing:
        raise ConfigError(f"{path / _WEIGHTS} lacks {', '.join(missing)}")
    return SparseDictionary(
        W_enc=weights["W_enc"], b_enc=weights["b_enc"], W_dec=weights["W_dec"], b_dec=weights["b_dec"],
        threshold=weights.get("threshold"), W_skip=weights.get("W_skip"), **_settings(cfg, str(path)),
    )  # fmt: skip


def from_sae_lens(sae: Any) -> SparseDictionary:
    """The dictionary of a sae-lens ``SAE`` object (its tensors are shared, not copied)."""
    cfg = sae.cfg.to_dict() if hasattr(sae.cfg, "to_dict") else dict(vars(sae.cfg))
    state = {k: v.detach() for k, v in sae.state_dict().items()}
    return SparseDictionary(
        W_enc=state["W_enc"], b_enc=state["b_enc"], W_dec=state["W_dec"], b_dec=state["b_dec"],
        threshold=state.get("threshold"), W_skip=state.get("W_skip"), **_settings(cfg, type(sae).__name__),
    )  # fmt: skip
