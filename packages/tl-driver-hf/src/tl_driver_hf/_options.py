"""Boot options of the ``hf`` driver, checked before anything is loaded."""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tl_core import ConfigError, UserError
from tl_core.driver_api import checked_path
from tl_core.gguf import gguf_source, require_gguf_packages
from tl_driver_hf._weights._checkpoints import checkpoint_revision

__all__ = ["BOOT_OPTIONS", "GGUF_EXTRA", "BootOptions", "parse_dtype"]

BOOT_OPTIONS: tuple[str, ...] = (
    "hf_config_overrides",
    "device",
    "device_map",
    "offload_folder",
    "max_memory",
    "n_devices",
    "dtype",
    "tokenizer",
    "load_weights",
    "trust_remote_code",
    "model_class",
    "hf_model",
    "n_ctx",
    "revision",
    "checkpoint_index",
    "checkpoint_value",
    "use_attn_result",
    "gguf_file",
    "certify",
)

#: What installs the packages transformers needs to read GGUF files.
GGUF_EXTRA = "pip install 'tl-driver-hf[gguf]'"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
}

# Options that only make sense when the driver loads the model itself.
_LOADING_OPTIONS = (
    "hf_config_overrides",
    "device",
    "device_map",
    "offload_folder",
    "max_memory",
    "n_devices",
    "dtype",
    "trust_remote_code",
    "model_class",
    "n_ctx",
    "revision",
    "checkpoint_index",
    "checkpoint_value",
    "gguf_file",
)


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name (``"bfloat16"``, ``"bf16"``, ...).

    Raises:
        ConfigError: Not a floating dtype tl supports.
    """
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ConfigError(
        f"dtype={value!r} is not supported; use one of float32, bfloat16, float16, float64 "
        f"(a torch.dtype or its name)"
    )


@dataclass(frozen=True)
class BootOptions:
    """Validated boot options (see ``HFDriver.boot`` for their meaning)."""

    model_name: str | None
    hf_model: Any = None
    hf_config_overrides: Mapping[str, Any] = field(default_factory=dict)
    device: str | None = None
    device_map: Any = None
    offload_folder: str | None = None
    max_memory: Mapping[Any, Any] | None = None
    n_devices: int | None = None
    dtype: torch.dtype = torch.float32
    tokenizer: Any = None
    load_weights: bool = True
    trust_remote_code: bool = False
    model_class: Any = None
    n_ctx: int | None = None
    revision: str | None = None
    use_attn_result: bool = False
    gguf_path: Path | None = None
    certify: bool = True

    @classmethod
    def parse(cls, model_name: Any, options: Mapping[str, Any]) -> BootOptions:
        """Check every option and combination; nothing is loaded.

        Raises:
            UserError: Unknown options, conflicting options or bad values, with the fix.
        """
        unknown = sorted(set(options) - set(BOOT_OPTIONS))
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, BOOT_OPTIONS, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise UserError(
                f"unknown hf driver options: {', '.join(hints)}. Valid options: model_name, "
                f"{', '.join(BOOT_OPTIONS)}"
            )
        opts = dict(options)
        hf_model = opts.get("hf_model")
        if hf_model is not None:
            _check_wrap(model_name, opts)
        elif model_name is None:
            raise UserError(
                "the hf driver needs model_name (a hub id or a local folder) or hf_model "
                "(a transformers model you already loaded)"
            )
        elif not isinstance(model_name, (str, os.PathLike)):
            raise UserError(
                f"model_name must be a hub id or a folder path, got {type(model_name).__name__}: "
                f"{model_name!r}; pass an already loaded model as hf_model=..."
            )
        name: str | None = (
            checked_path(model_name, "model_name", gguf=True) if model_name is not None else None
        )
        tokenizer = opts.get("tokenizer")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = checked_path(tokenizer, "tokenizer", gguf=False)
        load_weights = opts.get("load_weights", True)
        if not isinstance(load_weights, bool):
            raise UserError(f"load_weights must be True or False, got {load_weights!r}")
        if not load_weights and (opts.get("device_map") is not None or opts.get("n_devices")):
            raise UserError(
                "load_weights=False builds the model on the meta device; device_map/n_devices "
                "place weights, of which there are none. Drop one of them."
            )
        placement = _placement(opts)
        revision: str | None = opts.get("revision")
        if opts.get("checkpoint_index") is not None or opts.get("checkpoint_value") is not None:
            if revision is not None:
                raise UserError(
                    f"revision={revision!r} and a checkpoint option both pick a hub revision; "
                    f"pass only one"
                )
            if name is not None and os.path.isdir(name):
                raise UserError(
                    f"checkpoint_index/checkpoint_value pick a hub revision, but {name!r} is a "
                    f"local folder, which holds one set of weights"
                )
            revision = checkpoint_revision(
                name, opts.get("checkpoint_index"), opts.get("checkpoint_value")
            )
        overrides = opts.get("hf_config_overrides") or {}
        if not isinstance(overrides, Mapping):
            raise UserError(f"hf_config_overrides must be a dict, got {type(overrides).__name__}")
        gguf_path = gguf_source(name, opts.get("gguf_file"))
        if gguf_path is not None:
            require_gguf_packages(GGUF_EXTRA)
        if gguf_path is not None and revision is not None:
            raise UserError(
                f"revision={revision!r} picks a hub revision, but {str(gguf_path)!r} is a local "
                f"GGUF file; drop the revision/checkpoint option"
            )
        certify = opts.get("certify", True)
        if not isinstance(certify, bool):
            raise UserError(f"certify must be True or False, got {certify!r}")
        n_ctx = opts.get("n_ctx")
        if n_ctx is not None and (
            isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1
        ):
            raise UserError(f"n_ctx must be an int >= 1, got {n_ctx!r}")
        return cls(
            model_name=name,
            hf_model=hf_model,
            hf_config_overrides=dict(overrides),
            device=placement["device"],
            device_map=placement["device_map"],
            offload_folder=placement["offload_folder"],
            max_memory=placement["max_memory"],
            n_devices=placement["n_devices"],
            dtype=parse_dtype(opts["dtype"]) if opts.get("dtype") is not None else torch.float32,
            tokenizer=tokenizer,
            load_weights=load_weights,
            trust_remote_code=bool(opts.get("trust_remote_code", False)),
            model_class=opts.get("model_class"),
            n_ctx=n_ctx,
            revision=revision,
            use_attn_result=bool(opts.get("use_attn_result", False)),
            gguf_path=gguf_path,
            certify=certify,
        )


def _check_wrap(model_name: Any, opts: Mapping[str, Any]) -> None:
    given = [k for k in _LOADING_OPTIONS if opts.get(k) is not None]
    if opts.get("load_weights") is False:
        given.append("load_weights")
    if given:
        raise UserError(
            f"hf_model is wrapped as it is (never moved, cast or reconfigured), so "
            f"{', '.join(repr(g) for g in given)} cannot apply; move or cast the model yourself "
            f"before wrapping it, or load by model_name instead"
        )
    if model_name is not None:
        raise UserError(
            f"pass either model_name ({model_name!r}) or hf_model, not both: the wrapped "
            f"model already is the model"
        )
    if not callable(getattr(opts["hf_model"], "forward", None)):
        raise UserError(
            f"hf_model must be a transformers model (an nn.Module), got "
            f"{type(opts['hf_model']).__name__}"
        )


def _placement(opts: Mapping[str, Any]) -> dict[str, Any]:
    device, device_map = opts.get("device"), opts.get("device_map")
    n_devices = opts.get("n_devices")
    if device is not None and device_map is not None:
        raise UserError(
            f"device={device!r} and device_map={device_map!r} are mutually exclusive: use "
            f"device for one device, device_map ('auto' or a dict) to spread the model"
        )
    if n_devices is not None:
        if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
            raise UserError(f"n_devices must be an int >= 1, got {n_devices!r}")
        if device is not None or device_map is not None:
            raise UserError(
                "n_devices splits the layers over the first n CUDA devices itself; drop "
                "device/device_map, or drop n_devices"
            )
        plural = "s" if n_devices > 1 else ""
        _require_backend(
            f"n_devices={n_devices} needs {n_devices} CUDA device{plural}", "cuda", None
        )
        available = torch.cuda.device_count()
        if n_devices > available:
            raise UserError(
                f"n_devices={n_devices} needs {n_devices} CUDA devices, but {available} are visible"
            )
    _check_backends(device, device_map)
    spreads = device_map is not None or n_devices is not None
    if spreads and importlib.util.find_spec("accelerate") is None:
        raise UserError(
            "device_map and n_devices need the accelerate package, which is not installed; "
            "pip install 'tl-driver-hf[accelerate]' (or use device=... for one device)"
        )
    for key in ("offload_folder", "max_memory"):
        if opts.get(key) is not None and not spreads:
            raise UserError(
                f"{key} only applies with device_map (e.g. device_map='auto') or n_devices; "
                f"add one, or drop {key}"
            )
    if device_map is not None and not isinstance(device_map, (str, Mapping)):
        raise UserError(
            f"device_map must be 'auto', 'balanced', 'sequential', a device name or a dict, "
            f"got {type(device_map).__name__}"
        )
    offload = opts.get("offload_folder")
    return {
        "device": str(device) if device is not None else None,
        "device_map": device_map,
        "offload_folder": os.fspath(offload) if offload is not None else None,
        "max_memory": opts.get("max_memory"),
        "n_devices": n_devices,
    }


def _check_backends(device: Any, device_map: Any) -> None:
    """Refuse ``device`` or any device of ``device_map`` that this torch cannot use."""
    if device is not None:
        _require_backend(f"device={device!r} needs {{backend}}", _device_type(device), device)
    if isinstance(device_map, Mapping):
        for module, where in device_map.items():
            _require_backend(
                f"device_map[{module!r}]={where!r} puts {module!r} on a {{backend}} device",
                _device_type(where),
                where,
            )
    elif device_map is not None:
        _require_backend(
            f"device_map={device_map!r} needs {{backend}}", _device_type(device_map), device_map
        )


def _device_type(device: Any) -> str | None:
    """The torch device type ``device`` names, ``None`` for anything else ("auto", "disk").

    A bare int is a CUDA device index, as in accelerate's device maps.
    """
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return "cuda"
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        try:
            return torch.device(device).type
        except (RuntimeError, ValueError):
            return None
    return None


def _require_backend(what: str, kind: str | None, device: Any) -> None:
    """Refuse a CUDA or MPS device this torch build or machine cannot use.

    Args:
        what: The request, for the message; ``{backend}`` is replaced by the backend's name.
        kind: The device type asked for (``"cuda"``, ``"mps"``, ...).
        device: The device itself, whose CUDA index is checked against the visible count.

    Raises:
        ConfigError: The backend is missing (names torch's version and the fix), or the
            CUDA index is past the visible devices.
    """
    version = torch.__version__
    if kind == "cuda":
        what = what.replace("{backend}", "CUDA")
        if not torch.cuda.is_available():
            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
                raise ConfigError(
                    f"{what}, but this torch build ({version}) has no CUDA support. Use "
                    "device='cpu', or install a CUDA build of torch"
                )
            raise ConfigError(
                f"{what}, but torch {version} sees no CUDA device (no GPU, no driver, or "
                f"CUDA_VISIBLE_DEVICES hides them; check nvidia-smi). Use device='cpu', or run "
                f"where a GPU is visible"
            )
        index = device if isinstance(device, int) and not isinstance(device, bool) else None
        if isinstance(device, (str, torch.device)):
            index = torch.device(device).index
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            raise ConfigError(
                f"{what}, but CUDA device {index} does not exist: torch sees {count} "
                f"(cuda:0 to cuda:{count - 1}; CUDA_VISIBLE_DEVICES may hide others). Pick "
                f"one of those"
            )
    elif kind == "mps":
        what = what.replace("{backend}", "MPS (Apple Metal)")
        if not torch.backends.mps.is_available():
            why = (
                f"this torch build ({version}) has no MPS support"
                if not torch.backends.mps.is_built()
                else f"torch {version} cannot use MPS on this machine (it needs macOS 12.3+ on "
                f"Apple silicon)"
            )
            raise ConfigError(f"{what}, but {why}. Use device='cpu'")
