"""What the ``hf`` driver serves after its boot-time certification: a ``BootDecision``.

A described family serves the hooks its equations certify; an inferred architecture is
certified in stages, each serving less, and refused when even its residual stream fails.
Certification only tries configurations (``CertificationTrials``) and returns what to serve;
the driver applies the decision itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tl_core import ConfigError
from tl_core.certification import Certification
from tl_driver_hf._certification._certify import boot_refusal, on_residual_stream

__all__ = ["BootDecision", "BootFacts", "CertificationTrials", "certify_at_boot"]

_LOG = logging.getLogger("tl_driver_hf")


class CertificationTrials(Protocol):
    """A booted driver that can serve a trial set of hooks and certify it."""

    @property
    def candidate_hooks(self) -> Sequence[str]:
        """Every hook the model's modules offer, before certification."""

    def certify_serving(
        self,
        names: Sequence[str] | None,
        *,
        hooked_attention: bool,
        absent: Mapping[str, str],
        thorough: bool,
    ) -> Certification:
        """Serve ``names`` (``None``: as booted), with tl's attention or the model's, the
        ``absent`` ones not served for the reason given, and certify that."""


@dataclass(frozen=True)
class BootFacts:
    """What the boot knows of the model, for the report and the refusal."""

    name: str
    architecture: str
    family: str
    layers: str
    inferred: bool


@dataclass
class BootDecision:
    """What the driver serves after certification.

    Attributes:
        certification: The report of the configuration chosen.
        served: The hooks to serve (``None``: every candidate, as booted).
        absent: Hooks not served, each with why.
        hooked_attention: Whether tl's attention function runs (``False``: the model's own).
        readout_refused: Why the logit readout is refused (``None``: it held).
        refused_weights: Weights not served, each with why.
        passed_over: Why each fuller configuration an inferred model was tried with first
            was not chosen (its first failing check, or the error it raised).
    """

    certification: Certification
    served: list[str] | None = None
    absent: dict[str, str] = field(default_factory=dict)
    hooked_attention: bool = True
    readout_refused: str | None = None
    refused_weights: dict[str, str] = field(default_factory=dict)
    passed_over: list[str] = field(default_factory=list)


#: The configurations an inferred model is tried with, fullest first: (tl's attention, the
#: residual stream only, what the boot log calls it).
_TRIALS = (
    (True, False, "every hook with tl's attention"),
    (False, False, "with the model's own attention"),
    (False, True, "the residual stream alone"),
)


def _first_certifiable(trials: CertificationTrials, facts: BootFacts) -> BootDecision:
    """Certify an inferred model in stages, each serving less, until its run holds.

    First with every candidate hook and tl's hooked attention; then with the model's own
    attention (tl's may not reproduce a family's: sinks, extra inputs); then with the
    residual stream alone (a block whose insides do not run with tl's hooks).

    Raises:
        ConfigError: Not even the residual stream runs (names the error).
    """
    error: Exception | None = None
    tried: BootDecision | None = None
    passed_over: list[str] = []
    for hooked, residual_only, trial in _TRIALS:
        served: list[str] | None = None
        absent: dict[str, str] = {}
        if residual_only:
            names = list(trials.candidate_hooks)
            why = (
                f"{type(error).__name__}: {error}"
                if error is not None
                else "its block equations failed"
            )
            served = [n for n in names if on_residual_stream(n)]
            absent = {
                n: f"uncertified: tl's hooks inside this inferred block do not run ({why})"
                for n in names
                if not on_residual_stream(n)
            }
        try:
            cert = trials.certify_serving(
                served, hooked_attention=hooked, absent=absent, thorough=True
            )
        except Exception as exc:  # the family's code does not run with these hooks
            error = exc
            passed_over.append(f"{trial}: {type(exc).__name__}: {exc}")
            continue
        tried = BootDecision(
            cert, served=served, absent=absent, hooked_attention=hooked,
            passed_over=list(passed_over),
        )  # fmt: skip
        if cert.residual_holds:
            return tried
        wrong = [c for c in cert.failed if c.equation.startswith("logits") or c.on_residual]
        passed_over.append(f"{trial}: {wrong[0].line() if wrong else 'its run did not hold'}")
    if tried is not None:
        return tried  # refused by the caller, with the failing equations
    raise ConfigError(
        f"architecture {facts.architecture!r} has no hand-written description and tl "
        f"cannot run the one inferred from its modules ({type(error).__name__}: {error}); "
        f"describe it with an ArchitectureAdapter (docs/adding-a-family.md)."
    )


def certify_at_boot(trials: CertificationTrials, facts: BootFacts) -> BootDecision:
    """Certify, and decide to serve only what passed; refuse an inferred model whose run is wrong.

    Raises:
        ConfigError: The model's run is wrong where tl cannot leave hooks out.
    """
    if facts.inferred:
        decision = _first_certifiable(trials, facts)
    else:
        decision = BootDecision(
            trials.certify_serving(None, hooked_attention=True, absent={}, thorough=False)
        )
    cert = decision.certification
    refused = boot_refusal(
        cert, inferred=facts.inferred, architecture=facts.architecture, family=facts.family,
        layers=facts.layers, name=facts.name,
    )  # fmt: skip
    if refused is not None:
        raise refused
    candidates = decision.served if decision.served is not None else list(trials.candidate_hooks)
    dropped = [
        n for n in candidates if cert.statuses.get(n) is None or cert.statuses[n].status != "real"
    ]
    if dropped:
        for n in dropped:
            cert_n = cert.statuses.get(n)
            decision.absent[n] = f"uncertified: {cert_n.reason if cert_n else 'not checked'}"
        decision.served = [n for n in candidates if n not in dropped]
        if not facts.inferred:
            _LOG.warning(
                "%d hooks of %s failed certification and are not served (first: %s); see "
                "bridge.certification", len(dropped), facts.name, dropped[0],
            )  # fmt: skip
    wrong_readout = [
        c
        for c in cert.failed
        if c.hooks and set(c.hooks) <= {"unembed.hook_out", "ln_final.hook_out"}
    ]
    if wrong_readout:
        decision.readout_refused = f"failed: {wrong_readout[0].equation}"
    decision.refused_weights = {
        name: w.reason for name, w in cert.weights.items() if w.status != "real"
    }
    if facts.inferred:
        _LOG.warning(
            "%s: architecture %s inferred from its modules (no hand-written description); "
            "%d hooks certified and served at level %r%s (tl certify %s shows the report)",
            facts.name, facts.architecture, len(cert.served), cert.level,
            f", not {'; nor '.join(decision.passed_over)}" if decision.passed_over else "",
            facts.name,
        )  # fmt: skip
    return decision
