"""The Driver protocol every engine adapter implements, and its contract check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tl_core._errors import DriverContractError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FEATURES",
    "Driver",
    "ForwardResult",
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
    }
)


@dataclass(frozen=True)
class ForwardResult:
    """What one ``Driver.forward`` call returns.

    Batches are right-padded: row ``b`` of every tensor holds prompt ``b`` in its first
    ``lengths[b]`` positions; later positions are padding and carry no meaning.

    Attributes:
        logits: ``[batch, pos, d_vocab]`` sequence logits, or ``None`` when not requested
            or when the driver cannot provide them.
        captured: Canonical hook name to tensor (``[batch, pos, ...]``, on the CPU unless
            the caller asked otherwise).
        new_tokens: Generated token ids per prompt (``[batch, n]``), or ``None``.
        raw_output: The engine's own result object, for callers who need more.
        lengths: Real length of each prompt.
    """

    logits: torch.Tensor | None
    captured: Mapping[str, torch.Tensor]
    new_tokens: torch.Tensor | None = None
    raw_output: Any = None
    lengths: tuple[int, ...] = field(default=())


@runtime_checkable
class Driver(Protocol):
    """An execution engine seen through tl's hook vocabulary.

    Implementations live in driver distributions (and ``tl_core.native``) and are found
    through the ``tl_core.drivers`` entry-point group.
    """

    #: Canonical hook names this driver can fire (capture, and intervene where allowed).
    supported_hook_points: frozenset[str]
    #: Canonical hook names the engine structurally cannot serve (fused kernels, ...).
    non_fireable_hook_points: frozenset[str]
    #: Whether ``forward`` can return logits at every position (needed for ``loss``).
    provides_sequence_logits: bool

    def forward(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        *,
        capture: Sequence[str] = (),
        intervene: Any = None,
        max_new_tokens: int = 1,
        return_logits: bool = True,
        **kwargs: Any,
    ) -> ForwardResult:
        """Run prompts, capturing ``capture`` hooks and applying ``intervene`` specs.

        Args:
            input_ids: ``[batch, pos]`` ids or a list of (ragged) id lists.
            capture: Hook names (canonical or aliases) to return in ``captured``.
            intervene: ``{hook: spec | [spec, ...]}`` for every prompt, or a list with one
                such mapping (or ``None``) per prompt. Drivers that support
                ``intervention_callbacks`` also accept Python callables as values.
            max_new_tokens: Tokens to generate after the prompt (0 = prefill only).
            return_logits: Whether to return sequence logits.
            **kwargs: Driver-specific options; unknown ones must raise.

        Returns:
            A ``ForwardResult``.
        """
        ...

    def close(self) -> None:
        """Release the engine (processes, memory, sockets). Safe to call twice."""
        ...

    def supports(self, feature: str) -> bool:
        """Whether the driver has ``feature`` (one of ``FEATURES``)."""
        ...


_REQUIRED_METHODS = ("forward", "close", "supports")
_REQUIRED_SETS = ("supported_hook_points", "non_fireable_hook_points")


def validate_driver(driver: object, *, name: str | None = None) -> None:
    """Check that ``driver`` keeps the Driver contract.

    Args:
        driver: The object to check.
        name: The driver's registered name, for the error message.

    Raises:
        DriverContractError: Naming the first missing or malformed attribute.
    """
    label = f"driver {name!r} ({type(driver).__qualname__})" if name else type(driver).__qualname__
    for attr in _REQUIRED_METHODS:
        if not callable(getattr(driver, attr, None)):
            raise DriverContractError(
                f"{label} does not keep the Driver contract: method {attr!r} is missing "
                f"or not callable. Implement forward(), close() and supports()."
            )
    for attr in _REQUIRED_SETS:
        value = getattr(driver, attr, None)
        if not isinstance(value, frozenset) or not all(isinstance(v, str) for v in value):
            raise DriverContractError(
                f"{label} does not keep the Driver contract: attribute {attr!r} must be a "
                f"frozenset of canonical hook names, found {type(value).__name__}."
            )
    overlap = driver.supported_hook_points & driver.non_fireable_hook_points  # type: ignore[attr-defined]
    if overlap:
        raise DriverContractError(
            f"{label} declares hooks both supported and non-fireable: {sorted(overlap)[:5]}."
        )
    if not isinstance(getattr(driver, "provides_sequence_logits", None), bool):
        raise DriverContractError(
            f"{label} does not keep the Driver contract: attribute 'provides_sequence_logits' "
            f"must be a bool."
        )
    unknown = [f for f in FEATURES if not isinstance(driver.supports(f), bool)]  # type: ignore[attr-defined]
    if unknown:
        raise DriverContractError(
            f"{label}.supports({unknown[0]!r}) must return a bool."
        )
    _check_hook_names(label, driver.supported_hook_points)  # type: ignore[attr-defined]


def _check_hook_names(label: str, names: frozenset[str]) -> None:
    from tl_core._aliases import resolve_hook_name
    from tl_core._errors import HookNameError

    for hook in sorted(names):
        try:
            resolution = resolve_hook_name(hook)
        except HookNameError as exc:
            raise DriverContractError(
                f"{label} lists {hook!r} in supported_hook_points, which is not a hook name: {exc}"
            ) from None
        if resolution.status != "canonical":
            raise DriverContractError(
                f"{label} lists {hook!r} in supported_hook_points, which is not a canonical "
                f"hook name (it resolves to {resolution.canonical!r}). List canonical names."
            )
