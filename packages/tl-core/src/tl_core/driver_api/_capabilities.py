"""Optional driver capabilities, each a Protocol a driver implements.

The ``Driver`` protocol is what every driver has. What only some have is declared here, and
tl-core asks for it with ``isinstance`` against these Protocols, never by probing names:
a driver author reads in one place what implementing a capability takes, and mypy checks
the calls. Feature flags that need no method of their own (gradients, generation, position
interventions, ...) stay ``Driver.supports(feature)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tl_core._dictionaries._run import Attachment
    from tl_core.architecture._description import Architecture
    from tl_core.cache._readout import ModelReadout
    from tl_core.certification._report import Certification

__all__ = [
    "CertifyingDriver",
    "DescribingDriver",
    "DictionaryDriver",
    "ReadoutDriver",
    "SplitQKVDriver",
    "WeightFoldingDriver",
]


@runtime_checkable
class CertifyingDriver(Protocol):
    """Certifies the hooks it serves (``bridge.certification``, ``tl certify``)."""

    @property
    def certification(self) -> Certification | None:
        """The boot's certification report (``None`` when booted with ``certify=False``)."""
        ...

    def certify(self) -> Certification:
        """Run every check now, as ``tl certify`` does, and return the report."""
        ...


@runtime_checkable
class DescribingDriver(Protocol):
    """Says what the booted model is, independent of the engine (``bridge.architecture``)."""

    @property
    def architecture(self) -> Architecture | None:
        """The model's description (``None`` when the driver could not establish it)."""
        ...


@runtime_checkable
class ReadoutDriver(Protocol):
    """Hands the cache its final norm and unembedding (logit lens, direct attribution)."""

    def readout(self) -> ModelReadout | None:
        """The model's readout, or ``None`` when it has none to give."""
        ...


@runtime_checkable
class DictionaryDriver(Protocol):
    """Runs sparse dictionaries inside its own forward pass (engines outside this process).

    In-process drivers (``LocalDriver``) need not implement it: the bridge splices a
    dictionary into their hook tree itself.
    """

    def attach_dictionary(self, attachment: Attachment) -> None:
        """Run ``attachment`` in every later forward, and serve its sites, until detached."""
        ...

    def detach_dictionary(self, hook: str) -> None:
        """Take out the dictionary at canonical ``hook`` (and its sites)."""
        ...


@runtime_checkable
class SplitQKVDriver(Protocol):
    """Gives each attention head its own copy of the block input (``attn.hook_q_input``, ...)."""

    def set_use_split_qkv_input(self, enabled: bool) -> None:
        """Turn the per-head inputs on or off."""
        ...


@runtime_checkable
class WeightFoldingDriver(Protocol):
    """Can fold norms and centre weights as TransformerLens's ``HookedTransformer`` does."""

    def enable_compatibility_mode(self, **options: Any) -> None:
        """Rewrite the weights (options as ``TransformerBridge.enable_compatibility_mode``)."""
        ...
