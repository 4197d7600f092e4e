"""Certification: proof, on the booted model, that each served hook holds what its name promises.

A driver runs a few token ids through its model, captures its canonical hooks and checks
equations that hold for every transformer whatever its engine (the residual stream is a
chain, a block adds what its sublayers return, ``z`` is the pattern applied to the values,
the pattern is a softmax of the scores, a norm divides by its scale). Engine-specific
facts (the engine's own logits and hidden states, an edit made by a plain torch hook) come
in as references. A hook is served only when every check that covers it passes; the
report says, for each hook, its status and why.

This module holds the report and the comparison; the equations are in
``tl_core.certification._equations``. Everything is pure tensor arithmetic over a
``{canonical name: tensor}`` mapping, so any driver (hf, vllm, a third-party one) can
certify with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tl_core.hooks._vocabulary import STACK_PREFIXES

if TYPE_CHECKING:
    import torch

    from tl_core.architecture._description import Architecture


__all__ = [
    "CERTIFIED_STATUSES",
    "Certification",
    "CertificationCheck",
    "CertifiedStatus",
    "HookCertificate",
    "certified_level",
    "compare",
    "compare_differs",
    "statuses_from_checks",
]

#: What a hook is on a certified model: ``real`` (a tensor of the running model, vouched
#: for by an equation or by the family's hand-checked parity test), ``derived`` (computed
#: by tl from real tensors), ``reconstructed_read_only``, ``structurally_absent`` (the
#: architecture has no such tensor) or ``uncertified`` (not served: no equation could
#: vouch for it, or one failed).
CertifiedStatus = Literal[
    "real", "derived", "reconstructed_read_only", "structurally_absent", "uncertified"
]
CERTIFIED_STATUSES: tuple[CertifiedStatus, ...] = (
    "real",
    "derived",
    "reconstructed_read_only",
    "structurally_absent",
    "uncertified",
)
"""Every ``CertifiedStatus``, in report order."""


@dataclass(frozen=True)
class CertificationCheck:
    """One equation checked on the booted model.

    Attributes:
        equation: The equation, in canonical hook names (``"blocks.0.hook_out ==
            blocks.1.hook_in"``).
        hooks: The hooks this equation vouches for (they are served only if it passes).
        passed: Whether both sides agreed within ``allowed``.
        error: Largest absolute difference of the two sides (``inf`` when a side is
            missing or not finite).
        allowed: The tolerance used.
        detail: Why it failed (a hook that never fired, mismatched shapes), or ``""``.
    """

    equation: str
    hooks: tuple[str, ...]
    passed: bool
    error: float
    allowed: float
    detail: str = ""

    def line(self) -> str:
        """One line for reports: ``ok``/``FAIL``, the equation, the error against the tolerance."""
        mark = "ok  " if self.passed else "FAIL"
        extra = f" ({self.detail})" if self.detail else ""
        return f"{mark} {self.equation}  [err {self.error:.2e} <= {self.allowed:.2e}]{extra}"

    @property
    def on_residual(self) -> bool:
        """Whether the check vouches for a residual-stream hook (``blocks.i.hook_in``/``hook_out``)."""
        return any(h.endswith((".hook_in", ".hook_out")) and h.count(".") == 2 for h in self.hooks)


@dataclass(frozen=True)
class HookCertificate:
    """The status of one canonical hook and the reason.

    Attributes:
        status: One of ``CERTIFIED_STATUSES``.
        reason: Why: the equation that failed, what makes it absent, or what vouches for it.
    """

    status: CertifiedStatus
    reason: str


@dataclass(frozen=True)
class Certification:
    """The certification report of one booted model.

    Attributes:
        model: What was booted (name or folder).
        driver: The driver's name.
        family: The described family, or ``"inferred"`` (then ``inferred`` is true).
        inferred: Whether the architecture was inferred from the module tree (no
            hand-written description).
        level: ``"full"`` (attention and MLP sites certified), ``"sublayers"`` (attention
            and MLP outputs but not their insides) or ``"residual"`` (the residual stream,
            embedding, final norm and unembedding only).
        description: What the architecture is, as facts (``{"layers": "model.layers",
            "block": "sequential", ...}``): inferred ones say how they were found.
        checks: Every equation checked, in order.
        statuses: Canonical hook name -> its status and reason, for every name the
            model's structure suggests.
        weights: Weight name (``W_Q``, ``b_in``, ...) -> its status: ``real`` when it
            reproduces the activations it produces on the booted model, ``uncertified``
            (and refused by the driver) when it does not. Weights a driver does not check
            are absent.
        architecture: The engine-independent description of the booted model (block form,
            norms, attention and MLP variants, unembedding), or ``None`` where the driver
            gives none.
    """

    model: str
    driver: str
    family: str
    inferred: bool
    level: Literal["full", "sublayers", "residual"]
    description: Mapping[str, str]
    checks: tuple[CertificationCheck, ...]
    statuses: Mapping[str, HookCertificate] = field(default_factory=dict)
    weights: Mapping[str, HookCertificate] = field(default_factory=dict)
    architecture: Architecture | None = None

    @property
    def served(self) -> tuple[str, ...]:
        """Hooks served (status ``real`` or ``derived``), in forward order."""
        return tuple(n for n, c in self.statuses.items() if c.status in ("real", "derived"))

    @property
    def failed(self) -> tuple[CertificationCheck, ...]:
        """The checks that failed."""
        return tuple(c for c in self.checks if not c.passed)

    @property
    def residual_holds(self) -> bool:
        """Whether the run reproduces the model (logits, causality) and the residual stream
        certified: no failed check is a logits check or vouches for a residual hook."""
        return not any(c.equation.startswith("logits") or c.on_residual for c in self.failed)

    def by_status(self) -> dict[CertifiedStatus, list[str]]:
        """Hook names grouped by status (every status present, possibly empty)."""
        groups: dict[CertifiedStatus, list[str]] = {s: [] for s in CERTIFIED_STATUSES}
        for name, cert in self.statuses.items():
            groups[cert.status].append(name)
        return groups

    def format(self, *, verbose: bool = False) -> str:
        """The report as text: what the architecture is, hooks by status, failed checks.

        Args:
            verbose: Also list every passed check and every hook name (not only counts
                and templates).
        """
        how = "inferred from the module tree" if self.inferred else f"described ({self.family})"
        lines = [
            f"certification of {self.model} on the {self.driver} driver",
            f"architecture: {how}; served at level {self.level!r}",
        ]
        if self.architecture is not None:
            lines += [f"  {key}: {value}" for key, value in self.architecture.facts().items()]
        lines += [f"  {key}: {value}" for key, value in self.description.items()]
        lines.append(f"checks: {len(self.checks) - len(self.failed)} of {len(self.checks)} passed")
        for check in self.checks:
            if verbose or not check.passed:
                lines.append(f"  {check.line()}")
        refused = {n: c for n, c in self.weights.items() if c.status != "real"}
        if self.weights:
            lines.append(
                f"weights: {len(self.weights) - len(refused)} of {len(self.weights)} certified"
            )
            lines += [f"  refused {name}: {cert.reason}" for name, cert in refused.items()]
        lines.append("hooks:")
        for status, names in self.by_status().items():
            if not names:
                continue
            lines.append(f"  {status}: {len(names)}")
            shown = names if verbose else _templates(names)
            reasons: dict[str, str] = {}
            for n in names:  # a template's reason: its first layer's
                reasons.setdefault(_template(n), self.statuses[n].reason)
            for name in shown:
                reason = self.statuses[name].reason if verbose else reasons.get(name, "")
                lines.append(
                    f"    {name}" + (f"  ({reason})" if reason and status != "real" else "")
                )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _template(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 1 and parts[0] in STACK_PREFIXES and parts[1].isdigit():
        parts[1] = "{i}"
    return ".".join(parts)


def _templates(names: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for name in names:
        seen.setdefault(_template(name), None)
    return list(seen)


def compare(
    equation: str,
    hooks: Iterable[str],
    got: torch.Tensor | None,
    want: torch.Tensor | None,
    *,
    rtol: float,
    mask: torch.Tensor | None = None,
) -> CertificationCheck:
    """Check ``got == want`` within ``rtol`` of the larger of 1 and ``max |want|``.

    Args:
        equation: The equation's text.
        hooks: The hooks it vouches for.
        got: One side (``None``: a hook that never fired).
        want: The other side.
        rtol: Relative tolerance.
        mask: Where to compare (broadcast to both sides), or everywhere.
    """
    hooks = tuple(hooks)
    if got is None or want is None:
        return CertificationCheck(
            equation, hooks, False, math.inf, 0.0, "a hook on one side never fired"
        )
    if tuple(got.shape) != tuple(want.shape):
        detail = f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
        return CertificationCheck(equation, hooks, False, math.inf, 0.0, detail)
    a, b = got.detach().double(), want.detach().double()
    if mask is not None:
        a, b = a[mask.expand_as(a)], b[mask.expand_as(b)]
    if a.numel() == 0:
        return CertificationCheck(equation, hooks, True, 0.0, 0.0, "nothing to compare")
    scale = max(1.0, float(b.abs().max()))
    allowed = rtol * scale
    if not bool(a.isfinite().all() and b.isfinite().all()):
        return CertificationCheck(equation, hooks, False, math.inf, allowed, "a side is not finite")
    error = float((a - b).abs().max())
    return CertificationCheck(equation, hooks, error <= allowed, error, allowed)


def compare_differs(
    equation: str,
    hooks: Iterable[str],
    got: torch.Tensor | None,
    want: torch.Tensor | None,
    *,
    rtol: float,
) -> CertificationCheck:
    """Check that ``got`` and ``want`` differ by more than ``compare``'s tolerance: a change
    the model must see (an encoder's first positions read its last token) reached them.

    Fails, with why, where ``compare`` would pass, where a side is missing, where the shapes
    differ or where a side is not finite.
    """
    same = compare(equation, hooks, got, want, rtol=rtol)
    if same.error == math.inf or same.detail == "nothing to compare":
        return dataclasses.replace(same, passed=False)
    if same.passed:
        detail = "the two sides are equal within the tolerance: the change did not reach them"
        return dataclasses.replace(same, passed=False, detail=detail)
    return dataclasses.replace(same, passed=True)


def silent_hook_checks(names: Iterable[str], fired: Container[str]) -> list[CertificationCheck]:
    """A failed check for each hook in ``names`` that never fired in the driver's own forward.

    A certification run captures every hook the driver serves; one missing from what it
    captured is not in the driver's forward at all, so it cannot be certified.

    Args:
        names: The hooks the run asked for (leave out those that fire only on request).
        fired: The hooks the run captured.
    """
    return [
        CertificationCheck(
            f"{name} fires in a forward", (name,), False, math.inf, 0.0, "it never fired"
        )
        for name in names
        if name not in fired
    ]


def statuses_from_checks(
    names: Iterable[str],
    checks: Iterable[CertificationCheck],
    *,
    described: bool,
    absent: Mapping[str, str] | None = None,
    read_only: Mapping[str, str] | None = None,
    strict: bool = False,
) -> dict[str, HookCertificate]:
    """Each hook's status from the checks that cover it.

    A hook covered by a failed check is ``uncertified`` (the failed equation is the
    reason). A hook covered only by passed checks is ``real``. A hook no check covers is
    ``real`` on a described family (its parity test checks it by hand) and ``uncertified``
    on an inferred one.

    ``strict``: a passed equation vouches for its hooks only while none of its other
    hooks failed (``out == in + attn + mlp`` still holds when ``attn`` and ``mlp`` are
    swapped); a hook all of whose passed equations involve a failed hook is
    ``uncertified`` too, until nothing changes.

    Args:
        names: Every canonical name the structure suggests, in forward order.
        checks: The checks run.
        described: Whether the family has a hand-checked description.
        absent: Names the architecture lacks, with the reason (``structurally_absent``).
        read_only: Served names that take no edit, with the reason (still ``real``).
    """
    checks = list(checks)
    failed: dict[str, str] = {}
    passed: set[str] = set()
    for check in checks:
        for hook in check.hooks:
            if check.passed:
                passed.add(hook)
            else:
                failed.setdefault(
                    hook,
                    f"failed: {check.equation}" + (f" ({check.detail})" if check.detail else ""),
                )
    if strict:
        _withdraw_tainted(checks, failed, passed)
    out: dict[str, HookCertificate] = {}
    for name in names:
        if absent and name in absent:
            reason = absent[name]
            # A driver keeps the hooks it refused after certifying with their reasons.
            refused = reason.startswith("uncertified: ")
            status: CertifiedStatus = "uncertified" if refused else "structurally_absent"
            out[name] = HookCertificate(status, reason.removeprefix("uncertified: "))
        elif name in failed:
            out[name] = HookCertificate("uncertified", failed[name])
        elif name in passed:
            note = (read_only or {}).get(name, "")
            out[name] = HookCertificate(
                "real", f"read-only: {note}" if note else "checked by an equation"
            )
        elif described:
            out[name] = HookCertificate(
                "real", "described by hand; checked by the family's parity test"
            )
        else:
            out[name] = HookCertificate(
                "uncertified", "no equation checks it on an inferred architecture"
            )
    return out


def _withdraw_tainted(
    checks: list[CertificationCheck], failed: dict[str, str], passed: set[str]
) -> None:
    changed = True
    while changed:
        changed = False
        for hook in sorted(passed - set(failed)):
            covering = [c for c in checks if c.passed and hook in c.hooks]
            tainted = [
                next(h for h in c.hooks if h in failed)
                for c in covering
                if any(h in failed for h in c.hooks)
            ]
            if covering and len(tainted) == len(covering):
                failed[hook] = (
                    f"failed: every equation over it also covers {tainted[0]}, which failed"
                )
                changed = True


def certified_level(
    statuses: Mapping[str, HookCertificate], n_layers: int
) -> Literal["full", "sublayers", "residual"]:
    """How far certification proved a model: ``"full"`` when every block's attention
    pattern and sublayer outputs are real, ``"sublayers"`` when only the outputs are,
    else ``"residual"``."""
    served = {name for name, cert in statuses.items() if cert.status == "real"}
    blocks = range(n_layers)
    if not all(
        f"blocks.{i}.attn.hook_out" in served and f"blocks.{i}.mlp.hook_out" in served
        for i in blocks
    ):
        return "residual"
    return "full" if all(f"blocks.{i}.attn.hook_pattern" in served for i in blocks) else "sublayers"
