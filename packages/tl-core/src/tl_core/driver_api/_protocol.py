"""The Driver protocol every engine adapter implements, and its contract check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tl_core._errors import DriverContractError

if TYPE_CHECKING:
    from tl_core.driver_api._request import ForwardRequest, ForwardResult
    from tl_core.driver_api._tokenizers import Tokenizer
    from tl_core.hooks._model_info import ModelInfo
    from tl_core.hooks._namespace import HookNamespace

__all__ = [
    "FEATURES",
    "Driver",
    "NamespaceFacts",
    "validate_driver",
]

#: Capabilities a driver may declare through ``supports(feature)``.
FEATURES: frozenset[str] = frozenset(
    {
        "gradients",
        "parameters",
        "state_dict",
        "weight_access",
        "intervention_callbacks",
        "generation",
        "batching",
        "position_interventions",
        # Segment ids beside the prompts (an encoder's sentence A/B, ForwardRequest.token_type_ids).
        "token_type_ids",
        # Pixels beside the prompts (a vision-language model's images, ForwardRequest.images).
        "images",
    }
)


@runtime_checkable
class Driver(Protocol):
    """An execution engine seen through tl's hook vocabulary.

    Implementations live in driver distributions (and ``tl_core.native``) and are found
    through the ``tl_core.drivers`` entry-point group. ``packages/_template`` is a working
    driver to start from; ``tl_core.driver_api.check_driver`` runs the contract checks on
    a booted driver.

    Bridges call ``run`` with a ``ForwardRequest`` validated once; ``RequestForward``
    gives a driver ``forward``, its keyword form, for direct use.
    """

    #: The name users type to get this driver (its entry-point name).
    name: str
    #: The model's hook names as this driver serves them: every name a user passes is
    #: resolved here, for capture, specs and cache lookup alike.
    namespace: HookNamespace
    #: The model's sizes and structure (``namespace.info``).
    info: ModelInfo
    #: The tokenizer for text input (see ``tl_core.driver_api.HFTokenizer``).
    tokenizer: Tokenizer
    #: Canonical hook names this driver can fire (``namespace.served``).
    supported_hook_points: frozenset[str]
    #: Canonical hook names it cannot serve (``namespace.non_fireable``).
    non_fireable_hook_points: frozenset[str]
    #: Whether ``run`` can return logits at every position (needed for ``loss``).
    provides_sequence_logits: bool

    def run(self, request: ForwardRequest) -> ForwardResult:
        """Run one request: its prompts, capturing ``request.capture`` and applying
        ``request.plan``.

        The bridge builds the request once (``tl_core.driver_api.build_request``): the
        batch padded and in the vocabulary, every name resolved through ``namespace``,
        the specs checked into an ``InterventionPlan``, the layers and sampling options
        validated. A driver trusts it and does no validation of its own beyond what only
        its engine knows (its context length, say). Mix in ``RequestForward`` for the
        keyword form ``forward(input_ids, capture=..., intervene=...)``.

        Returns:
            A ``ForwardResult``: logits as ``request.logits`` asks, the captures under
            their canonical names, the new tokens when ``request.max_new_tokens >= 1``.
        """
        ...

    def close(self) -> None:
        """Release the engine (processes, memory, sockets). Safe to call twice."""
        ...

    def supports(self, feature: str) -> bool:
        """Whether the driver has ``feature`` (one of ``FEATURES``)."""
        ...


class NamespaceFacts:
    """The Driver protocol's derived attributes, read from the driver's ``namespace``.

    Mix it into a driver class and set ``self._namespace`` (or override ``namespace``);
    the hook sets then never disagree with the names the driver resolves.
    """

    _namespace: HookNamespace

    @property
    def namespace(self) -> HookNamespace:
        """The model's hook names as this driver serves them."""
        return self._namespace

    @property
    def supported_hook_points(self) -> frozenset[str]:
        """Every canonical hook the driver fires."""
        return self.namespace.served

    @property
    def non_fireable_hook_points(self) -> frozenset[str]:
        """Canonical hooks the driver cannot serve."""
        return self.namespace.non_fireable

    @property
    def non_fireable_reasons(self) -> Mapping[str, str]:
        """Why the driver cannot fire each hook it does not serve."""
        return self.namespace.non_fireable_reasons


_REQUIRED_METHODS = ("run", "close", "supports")
_REQUIRED_SETS = ("supported_hook_points", "non_fireable_hook_points")
_TOKENIZER_MEMBERS = (
    "encode",
    "decode",
    "token_to_str",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def validate_driver(driver: object, *, name: str | None = None) -> None:
    """Check that ``driver`` keeps the Driver contract.

    Args:
        driver: The object to check.
        name: The driver's registered name, for the error message.

    Raises:
        DriverContractError: Naming the first missing or malformed attribute.
    """
    from tl_core.hooks._model_info import ModelInfo
    from tl_core.hooks._namespace import HookNamespace

    label = f"driver {name!r} ({type(driver).__qualname__})" if name else type(driver).__qualname__

    def broken(what: str) -> DriverContractError:
        return DriverContractError(f"{label} does not keep the Driver contract: {what}")

    for attr in _REQUIRED_METHODS:
        if not callable(getattr(driver, attr, None)):
            raise broken(
                f"method {attr!r} is missing or not callable. Implement run(request), close() "
                f"and supports(). run takes one tl_core.driver_api.ForwardRequest (the "
                f"validated batch, resolved names and intervention plan); a driver written "
                f"with the keyword forward() of earlier releases reads those from the "
                f"request instead, and mixes in RequestForward to keep forward()."
            )
    namespace = getattr(driver, "namespace", None)
    if not isinstance(namespace, HookNamespace):
        raise broken(
            f"attribute 'namespace' must be a tl_core.driver_api.HookNamespace, found "
            f"{type(namespace).__name__}; build one with HookNamespace.build(info, served=...)."
        )
    info = getattr(driver, "info", None)
    if not isinstance(info, ModelInfo) or info != namespace.info:
        raise broken("attribute 'info' must be the ModelInfo of its namespace (namespace.info).")
    tokenizer = getattr(driver, "tokenizer", None)
    missing = [m for m in _TOKENIZER_MEMBERS if not hasattr(tokenizer, m)]
    if missing:
        raise broken(
            f"attribute 'tokenizer' lacks {missing} of the Tokenizer protocol; wrap a "
            f"transformers tokenizer in tl_core.driver_api.HFTokenizer."
        )
    for attr, expected in zip(
        _REQUIRED_SETS, (namespace.served, namespace.non_fireable), strict=True
    ):
        value = getattr(driver, attr, None)
        if value != expected:
            raise broken(
                f"attribute {attr!r} must equal its namespace's set (found "
                f"{type(value).__name__}); mix in tl_core.driver_api.NamespaceFacts."
            )
    if not isinstance(getattr(driver, "provides_sequence_logits", None), bool):
        raise broken("attribute 'provides_sequence_logits' must be a bool.")
    unknown = [f for f in sorted(FEATURES) if not isinstance(driver.supports(f), bool)]  # type: ignore[attr-defined]
    if unknown:
        raise DriverContractError(f"{label}.supports({unknown[0]!r}) must return a bool.")
