"""``InspectDriver``: tl's Driver protocol over an inspect_ai model provider.

``RemoteBridge.boot_inspect(model, provider="tl_bridge")`` builds the inspect model
(``get_model("tl_bridge/<model>")``), takes the tl driver that provider runs (``hf`` for
``tl_bridge``, ``vllm`` for ``tl_bridge_vllm``) and serves the Driver protocol by delegating
to it. The names, specs and tensors are therefore exactly the provider's: an analysis run
through this bridge sees the model an eval sees.

The driver is a remote-kind driver whichever engine sits below: the provider owns the
model, so there are no gradients and no Python intervention callbacks; hooks on the bridge
replay the captured values read-only.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import threading
from typing import Any

from tl_core import ModelInfo, UserError
from tl_core.driver_api import (
    ForwardRequest,
    ForwardResult,
    HookNamespace,
    NamespaceFacts,
    RequestForward,
    Tokenizer,
)

__all__ = ["PROVIDERS", "InspectDriver"]

#: The inspect_ai providers of this package and the tl driver each runs underneath.
PROVIDERS: dict[str, str] = {
    "tl_bridge": "hf",
    "tl_bridge_vllm": "vllm",
    "tl_hf": "hf",
    "tl_vllm": "vllm",
}
#: The unambiguous names of the providers (TransformerLens 4.3 also registers the first two).
_UNAMBIGUOUS = {"tl_bridge": "tl_hf", "tl_bridge_vllm": "tl_vllm"}

#: What a remote driver can do, whatever engine the provider runs (as the vLLM driver).
_FEATURES = frozenset({"generation", "batching", "position_interventions"})


class InspectDriver(RequestForward, NamespaceFacts):
    """An inspect_ai model provider of this package, serving tl's hooks.

    Boot it with ``RemoteBridge.boot_inspect(model, provider="tl_bridge", **options)``.
    Every hook, spec and tensor comes from the tl driver the provider runs; this class adds
    the remote contract on top (no callables, no partial forwards, no gradients) and
    serialises its calls with the provider's own.

    Attributes:
        name: ``"inspect"``, the entry-point name users type.
        provides_sequence_logits: Whether the provider's tl driver returns logits at every
            position (so ``loss`` works).
    """

    name = "inspect"

    def __init__(self, model: Any, *, provider: str, owned: bool) -> None:
        """Wrap a built inspect model (``Model`` or provider instance); see ``boot``.

        Args:
            model: An ``inspect_ai.model.Model`` of a ``tl_bridge*`` provider, or the
                provider (``ModelAPI``) itself.
            provider: The provider's name, for messages.
            owned: Whether ``close`` may shut the provider's engine down.

        Raises:
            ConfigError: The provider exposes no tl driver.
        """
        api = getattr(model, "api", model)
        inner = _inner_driver(api, provider)
        self._model: Any = model
        self._api: Any = api
        self._inner: Any | None = inner
        self._provider = provider
        self._owned = owned
        self._lock = _provider_lock(api)
        namespace: HookNamespace = inner.namespace
        self._namespace = dataclasses.replace(namespace, driver=self.name)
        self._tokenizer: Tokenizer = inner.tokenizer
        self.provides_sequence_logits: bool = bool(inner.provides_sequence_logits)
        self._features = frozenset(f for f in _FEATURES if inner.supports(f))

    @classmethod
    def boot(
        cls,
        model: Any,
        *,
        provider: str = "tl_bridge",
        **options: Any,
    ) -> InspectDriver:
        """Build the inspect model ``f"{provider}/{model}"`` and serve its tl driver.

        Args:
            model: What the provider loads (a local folder or a hub id). An absolute path
                gives ``tl_bridge//abs/path``, the form inspect needs. An
                ``inspect_ai.model.Model`` of a ``tl_bridge*`` provider is used as is (and
                not closed by ``close``).
            provider: ``"tl_bridge"`` (the hf driver) or ``"tl_bridge_vllm"`` (vLLM), or
                their unambiguous names ``"tl_hf"`` and ``"tl_vllm"``.
            **options: Passed to ``inspect_ai.model.get_model`` (model args of the
                provider, ``config=GenerateConfig(...)``, ...). ``memoize`` defaults to
                ``False``: the bridge gets its own engine, which ``close`` shuts down.

        Returns:
            The driver (``RemoteBridge.boot_inspect`` wraps it).

        Raises:
            ConfigError: An unknown provider (the message lists the known ones), or a model
                whose provider runs no tl driver, before anything loads.
        """
        if not isinstance(provider, str) or provider not in PROVIDERS:
            raise _unknown_provider(provider)
        if _is_inspect_model(model):
            if options:
                raise UserError(
                    f"boot_inspect got an inspect Model and options {sorted(options)}; options "
                    "are for building the model, so pass them to get_model() instead"
                )
            return cls(model, provider=_provider_name(model, provider), owned=False)
        from inspect_ai.model import get_model

        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if not isinstance(model, str) or not model:
            raise UserError(f"boot_inspect needs a model folder or id (str or path), got {model!r}")
        options.setdefault("memoize", False)
        owned = not options["memoize"]
        built = get_model(f"{provider}/{model}", **options)
        if not _is_tl_provider(built.api):
            built = _build_directly(provider, model, built, options, close_other=owned)
        try:
            return cls(built, provider=provider, owned=owned)
        except BaseException:
            if owned:
                _close_api(built.api)
            raise

    # -- facts ------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        """The model's sizes and structure."""
        return self.namespace.info

    @property
    def tokenizer(self) -> Tokenizer:
        """The provider's tokenizer."""
        return self._tokenizer

    @property
    def provider(self) -> str:
        """The inspect provider name (``tl_bridge`` or ``tl_bridge_vllm``)."""
        return self._provider

    @property
    def inspect_model(self) -> Any:
        """The ``inspect_ai.model.Model`` (or provider) this driver serves."""
        return self._model

    @property
    def inner(self) -> Any:
        """The tl driver the provider runs (``hf`` or ``vllm``).

        Raises:
            UserError: The driver was closed.
        """
        if self._inner is None:
            raise UserError(
                f"driver 'inspect' ({self._provider}) was closed; boot a new bridge with "
                "RemoteBridge.boot_inspect(...)"
            )
        return self._inner

    def supports(self, feature: str) -> bool:
        """Whether the driver has ``feature`` (generation, batching, position_interventions)."""
        return feature in self._features

    # -- running ----------------------------------------------------------------------

    def run(self, request: ForwardRequest) -> ForwardResult:
        """Run one validated request on the provider's tl driver (``forward`` is its keyword
        form; partial forwards and ``capture_device`` need a local driver).

        Returns:
            The provider driver's ``ForwardResult`` (right-padded, per-prompt lengths).
        """
        inner = self.inner
        with self._lock:
            result: ForwardResult = inner.run(request)
        return result

    def readout(self) -> Any:
        """The final norm and unembedding, from the provider's driver (cache analysis)."""
        readout = getattr(self.inner, "readout", None)
        return readout() if callable(readout) else None

    def close(self) -> None:
        """Shut the provider's engine down if this driver built it. Safe to call twice."""
        if self._inner is None:
            return
        self._inner = None
        if self._owned:
            _close_api(self._api)

    def __repr__(self) -> str:
        state = "closed" if self._inner is None else f"arch={self.info.architecture!r}"
        return f"InspectDriver(provider={self._provider!r}, {state})"


# -- helpers ----------------------------------------------------------------------------


def _unknown_provider(provider: object) -> UserError:
    from tl_core import ConfigError

    known = ", ".join(repr(p) for p in PROVIDERS)
    close = difflib.get_close_matches(str(provider), list(PROVIDERS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"unknown inspect provider {provider!r} for driver 'inspect'; tl-driver-inspect "
        f"provides {known} ('tl_bridge' and 'tl_hf' run the hf driver, 'tl_bridge_vllm' and "
        f"'tl_vllm' the vLLM driver, which needs pip install tl-driver-vllm).{hint}"
    )


def _is_inspect_model(model: object) -> bool:
    try:
        from inspect_ai.model import Model, ModelAPI
    except ImportError:  # pragma: no cover - inspect-ai is a dependency
        return False
    return isinstance(model, (Model, ModelAPI))


def _is_tl_provider(api: Any) -> bool:
    from tl_driver_inspect._provider import TLProvider

    return isinstance(api, TLProvider)


def _build_directly(
    provider: str, model: str, other: Any, options: dict[str, Any], *, close_other: bool
) -> Any:
    """Our provider, built without inspect's name lookup, when another package owns the name.

    inspect registers providers by bare name and takes the first registration, so a
    package that registers the same name (TransformerLens 4.3 registers ``tl_bridge`` and
    ``tl_bridge_vllm``) can win ``get_model``. The bridge then builds this package's
    provider class itself, and warns: evals given the model string run the other provider.
    """
    import warnings

    from inspect_ai.model import GenerateConfig, Model

    from tl_driver_inspect import _registry

    kind = type(other.api)
    warnings.warn(
        f"inspect resolved {provider!r} to {kind.__module__}.{kind.__qualname__}, another "
        f"package's provider registered under the same name; RemoteBridge.boot_inspect built "
        f"tl-driver-inspect's provider directly. Evals given the string {provider + '/' + model!r} "
        f"would run the other provider: give them {_UNAMBIGUOUS.get(provider, provider) + '/' + model!r} "
        f"or this bridge's driver.inspect_model instead",
        UserWarning,
        stacklevel=4,
    )
    if close_other:  # a memoized model may be in use elsewhere
        _close_api(other.api)
    args = {k: v for k, v in options.items() if k not in ("memoize", "role")}
    config = args.pop("config", None) or GenerateConfig()
    factory = getattr(_registry, provider)
    api = factory(model_name=model, config=config, **args)
    return Model(api, config, {k: v for k, v in args.items() if k not in ("base_url", "api_key")})


def _provider_name(model: Any, default: str) -> str:
    """``tl_bridge`` for a ``Model`` built as ``tl_bridge/<model>``."""
    try:
        qualified = str(model)
    except Exception:  # a bare ModelAPI without registry info
        qualified = ""
    name = qualified.split("/", 1)[0] if "/" in qualified else ""
    return name if name in PROVIDERS else default


def _inner_driver(api: Any, provider: str) -> Any:
    """The tl driver under a provider: ``api.bridge.driver`` (or ``api.driver``)."""
    from tl_core import ConfigError

    bridge = getattr(api, "bridge", None)
    driver = getattr(bridge, "driver", None) if bridge is not None else None
    if driver is None:
        driver = getattr(api, "driver", None)
    if driver is None or not hasattr(driver, "namespace"):
        raise ConfigError(
            f"the inspect model {getattr(api, 'model_name', api)!r} ({type(api).__name__}) runs "
            f"no tl driver, so driver 'inspect' cannot serve hooks for it; use a provider of "
            f"tl-driver-inspect: {', '.join(repr(p) for p in PROVIDERS)}. If another package "
            f"registers the same provider name (TransformerLens 4.3 registers 'tl_bridge'), "
            f"RemoteBridge.boot_inspect(<folder>) builds this package's provider directly"
        )
    return driver


def _provider_lock(api: Any) -> Any:
    """The lock the provider holds around its driver calls, or a private one."""
    for attr in ("lock", "_lock"):
        lock = getattr(api, attr, None)
        if lock is not None and hasattr(lock, "__enter__") and hasattr(lock, "acquire"):
            return lock
    return threading.RLock()


def _close_api(api: Any) -> None:
    close = getattr(api, "close", None)
    if callable(close):
        close()
