"""Checks of a capture job that run before anything is written: the specs of ``intervene``
and the context size, before the model boots where the model's config allows it, and
right after the boot otherwise."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tl_core._errors import HookNameError, SpecError, UserError
from tl_core.architecture._config import _N_CTX
from tl_core.capture._config import CaptureConfig

__all__ = [
    "ContextLimit",
    "booted_limit",
    "check_context_size",
    "check_intervene",
    "check_intervene_on",
    "context_limit_before_boot",
]

#: Boot options that change the native model's context (everything but these is a config field).
_NATIVE_BOOT_ARGS = ("device", "dtype")

#: ``(limit, where it comes from, how to raise it)``.
ContextLimit = tuple[int, str, str]


def check_intervene(intervene: Any, where: str) -> None:
    """Refuse a malformed ``intervene`` before the model boots.

    The structure is checked here (a mapping of hook name to a spec or a list of specs,
    each one parsed by ``parse_spec``); hook names, widths and positions depend on the
    model, and ``check_intervene_on`` checks them once it is booted.

    Args:
        intervene: The config's ``intervene`` (JSON values), or ``None``.
        where: Where the specs come from, for the messages (``"--intervene specs.json"``).

    Raises:
        SpecError: What is malformed, naming the hook, and the form that works.
    """
    from tl_core.specs import parse_spec

    if intervene is None:
        return
    example = '{"blocks.0.hook_resid_post": {"op": "add", "value": 1.0}}'
    if isinstance(intervene, Sequence) and not isinstance(intervene, str | bytes):
        raise SpecError(
            f"{where}: a capture applies one mapping of hook name to specs to every context, "
            f"found a list of {len(intervene)} entries (per-prompt specs do not fit contexts "
            f"cut from a corpus); give one mapping, e.g. {example}"
        )
    if not isinstance(intervene, Mapping):
        raise SpecError(
            f"{where}: expected a mapping of hook name to a spec or a list of specs, found "
            f"{type(intervene).__name__} {str(intervene)[:40]!r}; e.g. {example}"
        )
    for hook, entry in intervene.items():
        if not isinstance(hook, str):
            raise SpecError(f"{where}: hook names must be strings, found {hook!r}; e.g. {example}")
        items = (
            entry if isinstance(entry, Sequence) and not isinstance(entry, str | bytes) else [entry]
        )
        for item in items:
            try:
                parse_spec(item, hook=hook)
            except SpecError as error:
                raise SpecError(f"{where}: {error}") from None


def check_intervene_on(bridge: Any, config: CaptureConfig, where: str) -> None:
    """Refuse specs the booted model cannot apply: unknown hooks, hooks specs cannot edit,
    widths that do not fit, positions outside a context.

    Raises:
        SpecError, HookNameError: The message of ``build_plan``, prefixed with ``where``.
    """
    from tl_core.specs import build_plan

    if config.intervene is None:
        return
    try:
        build_plan(
            config.intervene,
            lengths=[config.context_size],
            namespace=bridge.namespace,
            allow_callables=False,
        )
    except (SpecError, HookNameError) as error:
        raise type(error)(f"{where}: {str(error).rstrip('.')}; nothing was written") from None


def context_limit_before_boot(config: CaptureConfig) -> ContextLimit | None:
    """The model's context, when its config can be read without booting it.

    Known for native presets (their config, with the boot options applied) and for
    ``hf``/``vllm`` models in a local folder whose ``config.json`` names the position
    limit (or whose boot options set it). ``None`` otherwise: the bridge's ``cfg.n_ctx``
    is checked right after the boot.

    Raises:
        ConfigError: A native config the boot would refuse as well.
    """
    options = config.boot_options
    if config.driver == "native":
        from tl_core.native._driver import _config

        overrides = {k: v for k, v in options.items() if k not in _NATIVE_BOOT_ARGS}
        native = _config(config.model, overrides)
        return (
            native.n_ctx,
            f"the native {config.model!r} config's n_ctx",
            "--option n_ctx=N (native models take any n_ctx)",
        )
    if config.driver == "hf":
        if _positive_int(options.get("n_ctx")):
            return int(options["n_ctx"]), "the boot option n_ctx", "a larger --option n_ctx=N"
        overrides = options.get("hf_config_overrides") or {}
        raise_it = (
            "--option n_ctx=N (rotary models only; learned position tables have a fixed size)"
        )
        found = _config_limit(
            config.model,
            options,
            overrides if isinstance(overrides, Mapping) else None,
            rope_ok=True,
        )
        return None if found is None else (found[0], found[1], raise_it)
    if config.driver == "vllm":
        # vLLM counts the token it samples against max_model_len: the model runs one
        # position fewer (the vllm driver's n_ctx, tl_core.driver_api.fits_context).
        if _positive_int(options.get("max_model_len")):
            return (
                int(options["max_model_len"]) - 1,
                f"the boot option max_model_len={options['max_model_len']}, less the token "
                "vLLM samples",
                "a larger --option max_model_len=N",
            )
        if any("override" in key for key in options):
            return None
        found = _config_limit(config.model, options, {}, rope_ok=False)
        return (
            None
            if found is None
            else (
                found[0] - 1,
                f"{found[1]}, less the token vLLM samples",
                "--option max_model_len=N where the model allows it",
            )
        )
    return None


def _config_limit(
    model: str, options: Mapping[str, Any], overrides: Mapping[str, Any] | None, *, rope_ok: bool
) -> tuple[int, str] | None:
    """The position limit a local folder's ``config.json`` names, read as the drivers read it."""
    from tl_core.architecture import model_info_from_config

    folder = Path(model).expanduser()
    path = folder / "config.json"
    if overrides is None or options.get("gguf_file") or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the driver reports an unreadable config when it boots
    if not isinstance(data, dict):
        return None
    data = {**data, **overrides}
    if not any(data.get(name) is not None for name in _N_CTX):
        return None  # transformers would fill in its class default; the boot tells
    if not rope_ok and any(
        isinstance(data.get(k), dict) and "factor" in data[k]
        for k in ("rope_scaling", "rope_parameters")
    ):
        return None  # vLLM stretches the limit by the rope scaling factor
    try:
        info = model_info_from_config(
            _Fields(data),
            normalization_type=None,
            positional_embedding_type="standard",
            gated_mlp=False,
        )
    except Exception:  # an incomplete config: the driver's boot reports it properly
        return None
    return info.n_ctx, f"{path}"


class _Fields:
    """A config.json's fields as attributes, as ``model_info_from_config`` reads them."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.__dict__.update(data)

    def __getattr__(self, name: str) -> Any:
        return None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_context_size(config: CaptureConfig, limit: ContextLimit, *, booted: bool) -> None:
    """Refuse a context size above the model's context.

    Raises:
        UserError: The sizes, where the limit comes from, and the ways out.
    """
    n_ctx, source, raise_it = limit
    if n_ctx <= 0 or config.context_size <= n_ctx:
        return
    when = (
        "checked after the boot; nothing was written"
        if booted
        else "checked before the model boots"
    )
    raise UserError(
        f"context_size (--context-size) {config.context_size} is longer than model "
        f"{config.model!r} takes on driver {config.driver!r}: {n_ctx} tokens ({source}; {when}). "
        f"Pass --context-size {n_ctx} or less, or boot with {raise_it}"
    )


def booted_limit(bridge: Any, config: CaptureConfig) -> ContextLimit | None:
    """The booted model's context (``cfg.n_ctx``), with the way to raise it on its driver."""
    n_ctx = getattr(getattr(bridge, "cfg", None), "n_ctx", 0)
    if not _positive_int(n_ctx):
        return None
    raise_it = {
        "native": "--option n_ctx=N (native models take any n_ctx)",
        "hf": "--option n_ctx=N (rotary models only; learned position tables have a fixed size)",
        "vllm": "--option max_model_len=N where the model allows it",
    }.get(config.driver, "the driver's option for a longer context, if it has one")
    return int(n_ctx), "the booted model's n_ctx", raise_it
