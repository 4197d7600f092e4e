"""Per-sample state shared by the solvers and the providers, through a ``ContextVar``.

inspect_ai runs each sample (and epoch) as its own task, so a ``ContextVar`` set by a
solver is seen by that sample's provider calls and by no other sample's. Solvers never
mutate a scope they did not create for their own sample: ``sample_scope`` starts a fresh
one whenever the current value belongs to another ``TaskState``.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GenerationRecord", "SampleScope", "current_scope", "sample_scope"]


@dataclass(frozen=True)
class GenerationRecord:
    """What one provider call ran: the ids in and out, and the specs it applied.

    Attributes:
        prompt_ids: The prompt's token ids (chat template applied).
        generated_ids: The tokens the completion stands for (cut at EOS and stop sequences).
        specs: The specs applied, hook name -> list of spec dicts (``None``: none).
    """

    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    specs: dict[str, list[dict[str, Any]]] | None


@dataclass
class SampleScope:
    """One sample's tl state: its specs and the provider calls made for it.

    Attributes:
        owner: ``id()`` of the sample's ``TaskState`` (a scope is never shared).
        specs: Hook name (as given) -> specs, composed in the order solvers added them.
        capturing: Whether a capture solver is generating for this sample.
        records: The provider calls made while this scope was current.
    """

    owner: int
    specs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    capturing: bool = False
    records: list[GenerationRecord] = field(default_factory=list)

    def driver_specs(self) -> dict[str, list[dict[str, Any]]] | None:
        """The specs as ``intervene=`` takes them (``None`` when there are none)."""
        return {k: list(v) for k, v in self.specs.items()} if self.specs else None


_SCOPE: ContextVar[SampleScope | None] = ContextVar("tl_driver_inspect_scope", default=None)


def current_scope() -> SampleScope | None:
    """The running sample's scope, if a tl solver set one."""
    return _SCOPE.get()


def sample_scope(state: object) -> SampleScope:
    """The scope of the sample whose ``TaskState`` is ``state`` (created on first use)."""
    scope = _SCOPE.get()
    if scope is None or scope.owner != id(state):
        scope = SampleScope(owner=id(state))
        _SCOPE.set(scope)
    return scope
