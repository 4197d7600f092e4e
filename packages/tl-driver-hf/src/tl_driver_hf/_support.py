"""Offline support checks, model listings and bridge builders of the ``hf`` driver."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tl_core import ModelInfo, UserError
from tl_core.driver_api import checked_path
from tl_driver_hf._weights._checkpoints import series_for
from tl_driver_hf.adapters import ArchitectureAdapter, all_adapters, find_adapter

if TYPE_CHECKING:
    from tl_core import TransformerBridge

__all__ = [
    "SupportReport",
    "build_bridge_config_from_hf",
    "build_bridge_from_module",
    "check_model_support",
    "list_supported_models",
]


@dataclass(frozen=True)
class SupportReport:
    """Whether the ``hf`` driver can run a model, and why.

    Attributes:
        name: What was asked about (hub id, folder, architecture or config class).
        supported: Whether an adapter serves it.
        family: The adapter's family, or ``None``.
        model_type: The config's ``model_type`` where known.
        architecture: The ``*ForCausalLM`` class name where known.
        verified: Whether the family is checked hook by hook by the driver's tests.
        checkpointed: Whether training checkpoints can be picked (``checkpoint_index``).
        reason: One sentence saying how the answer was reached.
    """

    name: str
    supported: bool
    family: str | None
    model_type: str | None
    architecture: str | None
    verified: bool
    checkpointed: bool
    reason: str

    def __bool__(self) -> bool:
        return self.supported


def _families() -> str:
    return ", ".join(sorted({a.family for a in all_adapters()}))


def _report(
    name: str,
    adapter: ArchitectureAdapter | None,
    model_type: str | None,
    architecture: str | None,
    how: str,
) -> SupportReport:
    checkpointed = series_for(name) is not None
    if adapter is None:
        what = architecture or model_type or name
        return SupportReport(
            name,
            False,
            None,
            model_type,
            architecture,
            False,
            checkpointed,
            f"{what!r} ({how}) matches no adapter, so booting it infers its architecture from "
            f"the module tree and serves what certification proves (tl certify shows it); "
            f"described families: {_families()}",
        )
    return SupportReport(
        name,
        True,
        adapter.family,
        model_type or adapter.model_types[0],
        architecture or adapter.architectures[0],
        adapter.verified,
        checkpointed,
        f"{how}: served by the {adapter.family!r} adapter",
    )


def check_model_support(model_name_or_config: Any) -> SupportReport:
    """Say whether the ``hf`` driver supports a model, without touching the network.

    Accepts a local folder (its ``config.json`` is read), a transformers config object, an
    architecture class name (``"LlamaForCausalLM"``), a ``model_type`` (``"llama"``) or a
    hub id, which is matched against known id patterns of each family (a hub id no pattern
    matches is reported unsupported, saying the answer came from its name). A path that
    does not exist, or a file that is no folder, is reported unsupported with the fix.

    Args:
        model_name_or_config: What to check.

    Returns:
        A ``SupportReport`` (truthy when supported).

    Raises:
        UserError: Something that is neither a string, a path nor a config.
    """
    value = model_name_or_config
    if hasattr(value, "model_type") and not isinstance(value, (str, os.PathLike)):
        model_type = getattr(value, "model_type", None)
        archs = tuple(getattr(value, "architectures", None) or ())
        adapter = find_adapter(model_type, archs)
        return _report(
            type(value).__name__, adapter, model_type, archs[0] if archs else None, "config object"
        )
    if not isinstance(value, (str, os.PathLike)):
        raise UserError(
            f"check_model_support takes a hub id, a folder, an architecture name or a config, "
            f"got {type(value).__name__}"
        )
    try:
        name = checked_path(value, "model_name_or_config", gguf=True)
    except UserError as exc:  # a mistyped path is no hub id: say so rather than guess
        return SupportReport(os.fspath(value), False, None, None, None, False, False, str(exc))
    if os.path.isdir(name):
        path = os.path.join(name, "config.json")
        if not os.path.isfile(path):
            return SupportReport(
                name, False, None, None, None, False, False, f"folder {name!r} has no config.json"
            )
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        archs = tuple(data.get("architectures") or ())
        model_type = data.get("model_type")
        adapter = find_adapter(model_type, archs)
        return _report(
            name, adapter, model_type, archs[0] if archs else None, "config.json of a local folder"
        )
    adapter = find_adapter(None, (name,))
    if adapter is not None:
        return _report(name, adapter, None, name, "architecture class name")
    adapter = find_adapter(name, None)
    if adapter is not None:
        return _report(name, adapter, name, None, "model_type")
    adapter = next((a for a in all_adapters() if a.matches_hub_id(name)), None)
    how = "hub id pattern" if adapter is not None else "hub id, judged by its name offline"
    return _report(name, adapter, None, None, how)


def list_supported_models(
    architecture: str | None = None, verified_only: bool = False
) -> list[str]:
    """Hub ids of well-known checkpoints the ``hf`` driver supports.

    Args:
        architecture: Only this family, ``model_type`` or architecture class name.
        verified_only: Only families the driver's tests check hook by hook.

    Returns:
        Hub ids, sorted.

    Raises:
        UserError: ``architecture`` matches no adapter.
    """
    adapters = all_adapters()
    if architecture is not None:
        adapters = tuple(
            a for a in adapters if architecture in (a.family, *a.model_types, *a.architectures)
        )
        if not adapters:
            raise UserError(
                f"no adapter serves {architecture!r}; supported families: {_families()}"
            )
    if verified_only:
        adapters = tuple(a for a in adapters if a.verified)
    return sorted({m for a in adapters for m in a.description.known_models})


def build_bridge_config_from_hf(hf_config: Any) -> ModelInfo:
    """The ``ModelInfo`` tl reports for a transformers config.

    Raises:
        ConfigError: The architecture is not supported.
    """
    from tl_driver_hf._weights._loading import adapter_for_config

    return adapter_for_config(hf_config).description.model_info(hf_config)


def build_bridge_from_module(
    hf_model: Any, tokenizer: Any = None, **options: Any
) -> TransformerBridge:
    """Wrap a transformers model you already loaded (e.g. quantised) in a bridge.

    The model is never moved, cast or changed; only removable hooks attach while tl runs
    it.

    Args:
        hf_model: A transformers ``*ForCausalLM`` model.
        tokenizer: Its tokenizer (object, or a local folder to load one from).
        **options: Further ``hf`` driver options that apply to a wrapped model
            (``use_attn_result``).

    Returns:
        A ``TransformerBridge``.
    """
    from tl_core import TransformerBridge
    from tl_driver_hf._driver import HFDriver

    return TransformerBridge(HFDriver.boot(hf_model=hf_model, tokenizer=tokenizer, **options))
