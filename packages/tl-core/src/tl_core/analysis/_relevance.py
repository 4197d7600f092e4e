"""LRP-style relevance rules swapped into the backward pass (RelP's propagation rules).

Relevance Patching (RelP) is attribution patching whose gradient follows layer-wise
relevance propagation rules instead of the plain chain rule. Each rule is installed as a
forward hook on canonical hook sites that returns ``value.detach() + (R - R.detach())``,
where ``R`` equals the value but is built from differently differentiable pieces: the site
hands on its value bit for bit (``R - R.detach()`` is exactly zero) and the backward is the
gradient of ``R``:

* LN-rule at ``*.hook_normalized``: ``R = centre(hook_in) / sg(hook_scale)`` (no centring
  for RMSNorm), so the norm's divisor is a constant.
* Identity-rule at ``mlp.hook_post``: ``act(pre)`` becomes ``pre * sg(act(pre) / pre)``
  (``1/2`` where ``pre == 0``, the limit for GELU and SiLU).
* Half-rule at ``mlp.hook_post`` of gated MLPs: ``a * b`` becomes
  ``(a * sg(b) + sg(a) * b) / 2``, so each factor gets half the product's gradient.
* Attention rule at ``attn.hook_pattern``: the pattern becomes a constant (a fresh leaf that
  still receives its own gradient, so backward hooks there keep working).

Rules read their inputs from other sites (``hook_in``, ``hook_scale``, ``mlp.hook_pre``,
``mlp.hook_pre_linear``) after every user hook there, so edits of those inputs are honoured;
the sites a rule replaces refuse edits while the rule is active.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from tl_core._errors import UnsupportedFeatureError, UserError
from tl_core.hooks._hook_point import HookHandle, HookPoint, RuleHook
from tl_core.hooks._model_info import ModelInfo

__all__ = ["RelevanceCoverage", "RelevanceRules", "SiteCoverage", "use_relevance_rules"]

Activation = Callable[[torch.Tensor], torch.Tensor]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


#: Activations the rules can evaluate, by the names configs use (native and transformers).
_ACTIVATIONS: dict[str, Activation] = {
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
}
#: ReLU and its kin: f(x)/x jumps at 0 (and is ReLU's own gradient elsewhere), so the
#: Identity rule, meant for smooth activations, is refused for them.
_RELU_FAMILY = frozenset({"relu", "relu2", "relu6", "leaky_relu", "prelu"})
# Largest deviation of a rule's R from the value it replaces, relative to 1 + max|value|,
# before the first forward declares the rule unable to reproduce the site.
_TOLERANCE = {torch.float64: 1e-8, torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 5e-2}

RuleName = Literal["LN", "Identity", "Half", "Identity+Half", "attention"]
#: How to run without a rule that cannot be honoured.
_WITHOUT = {
    "normalization": "pass RelevanceRules(normalization=False) to run without the LN rule",
    "activation": "pass RelevanceRules(activation=False) to run without the MLP rule",
    "gated": (
        "pass RelevanceRules(activation=False, multiplicative_gate=False) to run without "
        "the MLP rules"
    ),
    "attention": "pass RelevanceRules(attention=False) to run without the attention rule",
}


@dataclass(frozen=True)
class RelevanceRules:
    """Which LRP rules ``use_relevance_rules`` swaps into the backward pass.

    Attributes:
        normalization: LN-rule: every norm's divisor (``hook_scale``) is a constant.
        activation: Identity-rule for SiLU/GELU: the backward multiplier is ``f(x)/x``
            (``1/2`` at ``x == 0``).
        multiplicative_gate: Half-rule for ``act(gate) * up`` in gated MLPs: each factor
            gets half of the product's gradient.
        attention: Attention probabilities are constants (no gradient through softmax).
    """

    normalization: bool = True
    activation: bool = True
    multiplicative_gate: bool = True
    attention: bool = True

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not isinstance(value, bool):
                raise UserError(f"RelevanceRules.{item.name} must be True or False, got {value!r}.")


@dataclass(frozen=True)
class SiteCoverage:
    """What the rules do at one canonical site.

    Attributes:
        site: The canonical hook whose backward a rule replaces.
        rule: ``"LN"``, ``"Identity"``, ``"Half"``, ``"Identity+Half"`` or ``"attention"``.
        installed: Whether the rule is active there.
        reads: Canonical hooks the rule reads its inputs from.
        reason: Why it is not installed (empty when it is).
    """

    site: str
    rule: RuleName
    installed: bool
    reads: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class RelevanceCoverage:
    """Every site the requested rules concern, installed or skipped with the reason.

    ``str(coverage)`` is a table; ``installed`` and ``skipped`` are for code.

    Attributes:
        rules: The rules asked for.
        architecture: The model's ``ModelInfo.architecture``.
        act_fn: The activation the MLP rules assumed (``ModelInfo.act_fn``).
        sites: One row per site, in forward order.
    """

    rules: RelevanceRules
    architecture: str
    act_fn: str | None
    sites: tuple[SiteCoverage, ...]

    @property
    def installed(self) -> dict[str, RuleName]:
        """Site -> rule, for every site where a rule is active."""
        return {s.site: s.rule for s in self.sites if s.installed}

    @property
    def skipped(self) -> dict[str, str]:
        """Site -> why no rule is active there."""
        return {s.site: s.reason for s in self.sites if not s.installed}

    def __str__(self) -> str:
        head = (
            f"relevance rules on {self.architecture or 'model'!r} (act_fn={self.act_fn!r}): "
            f"{len(self.installed)} installed, {len(self.skipped)} skipped"
        )
        width = max([len("site"), *(len(s.site) for s in self.sites)])
        lines = [head, f"{'site':<{width}}  {'rule':<13}  {'status':<9}  reads / reason"]
        for s in self.sites:
            status = "installed" if s.installed else "skipped"
            detail = (", ".join(s.reads) or "(nothing)") if s.installed else s.reason
            lines.append(f"{s.site:<{width}}  {s.rule:<13}  {status:<9}  {detail}")
        return "\n".join(lines)


# -- the hooks ------------------------------------------------------------------------


class _Tap(RuleHook):
    """Keeps the value a site hands on (after user hooks) until the rule that reads it."""

    stage: ClassVar[Literal["first", "last"]] = "last"

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def __call__(self, tensor: torch.Tensor, /, *, hook: HookPoint) -> None:
        self.value = tensor

    def take(self, reader: str, name: str) -> torch.Tensor:
        value, self.value = self.value, None
        if value is None:
            raise UnsupportedFeatureError(
                f"the relevance rule at {reader!r} reads {name!r}, which did not fire "
                f"before it in this forward; this driver computes {reader!r} without "
                f"{name!r}, so the rule cannot be applied there. Turn the rule off in "
                f"RelevanceRules to run without it."
            )
        return value


class _Replacing(RuleHook):
    """A rule hook that replaces its site's value; it runs before every user hook."""

    stage: ClassVar[Literal["first", "last"]] = "first"
    rule: RuleName
    #: Why the site's value no longer reaches the model, or ``None`` (set when installed).
    unreachable: Callable[[str], str | None] = staticmethod(lambda site: None)

    def ensure_reachable(self, site: str) -> None:
        # The driver can change what reads a site mid-scope (per-head q/k/v inputs).
        reason = self.unreachable(site)
        if reason is not None:
            raise UnsupportedFeatureError(
                f"the {self.rule} relevance rule is active at {site!r}, but the model no "
                f"longer reads that value ({reason}), so the rule would not reach the "
                f"gradient. Undo that change inside use_relevance_rules(...), or turn the "
                f"rule off in RelevanceRules."
            )


class _Rule(_Replacing):
    """Replaces a site's value by ``value.detach() + (R - R.detach())``."""

    def __init__(self, taps: tuple[tuple[str, _Tap], ...]) -> None:
        self.taps = taps
        self.checked = False

    def __call__(self, tensor: torch.Tensor, /, *, hook: HookPoint) -> torch.Tensor | None:
        inputs = [tap.take(hook.name, name) for name, tap in self.taps]
        if not torch.is_grad_enabled():
            return None
        self.ensure_reachable(hook.name)
        r = self.relevance(tensor, *inputs).to(tensor.dtype)
        if r.shape != tensor.shape:
            shapes = ", ".join(
                f"{n} {tuple(x.shape)}" for (n, _), x in zip(self.taps, inputs, strict=True)
            )
            raise UnsupportedFeatureError(
                f"the {self.rule} rule at {hook.name!r} rebuilt a {tuple(r.shape)} value from "
                f"{shapes}, but the site holds {tuple(tensor.shape)}: this driver lays the "
                f"site out in a way the rule does not recognise. Turn the rule off in "
                f"RelevanceRules for this model."
            )
        if not self.checked:
            _check_reproduces(self.rule, hook.name, r, tensor)
            self.checked = True
        return tensor.detach() + (r - r.detach())

    def relevance(self, value: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _NormRule(_Rule):
    rule: RuleName = "LN"

    def __init__(self, taps: tuple[tuple[str, _Tap], ...], *, centre: bool) -> None:
        super().__init__(taps)
        self.centre = centre

    def relevance(self, value: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        x, scale = inputs
        x = x.to(value.dtype)
        if self.centre:
            x = x - x.mean(dim=-1, keepdim=True)
        return x / scale.detach().to(value.dtype)


class _MlpRule(_Rule):
    def __init__(
        self,
        taps: tuple[tuple[str, _Tap], ...],
        *,
        act: Activation,
        identity: bool,
        half: bool,
        rule: RuleName,
    ) -> None:
        super().__init__(taps)
        self.act, self.identity, self.half, self.rule = act, identity, half, rule

    def relevance(self, value: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        pre = inputs[0]
        if self.identity:
            with torch.no_grad():
                # f(x)/x -> 1/2 as x -> 0 for GELU and SiLU; denormals would lose f(x).
                tiny = pre.abs() < torch.finfo(pre.dtype).tiny
                ratio = torch.where(tiny, torch.full_like(pre, 0.5), self.act(pre) / pre)
            a = pre * ratio
        else:
            a = self.act(pre)
        if len(inputs) == 1:
            return a
        up = inputs[1]
        if self.half:
            return 0.5 * (a * up.detach() + a.detach() * up)
        return a * up


class _PatternRule(_Replacing):
    """Attention probabilities as constants: a fresh leaf with the pattern's values."""

    rule: RuleName = "attention"

    def __call__(self, tensor: torch.Tensor, /, *, hook: HookPoint) -> torch.Tensor | None:
        if not (torch.is_grad_enabled() and tensor.requires_grad):
            # A new tensor of the same value: drivers then keep their fused kernel's bits.
            return tensor.detach()
        self.ensure_reachable(hook.name)
        # A leaf rather than a plain detach: the pattern's own gradient (and backward hooks
        # on it) survive; only the path into scores, q and k is cut.
        return tensor.detach().requires_grad_()


def _check_reproduces(rule: str, site: str, r: torch.Tensor, value: torch.Tensor) -> None:
    """Refuse a rule whose ``R`` is not the site's value: it would reach the wrong place."""
    if value.numel() == 0:
        return
    with torch.no_grad():
        err = float((r.float() - value.float()).abs().max())
        bound = _TOLERANCE.get(value.dtype, 5e-2) * (1.0 + float(value.float().abs().max()))
    if not err <= bound:  # also catches NaN
        raise UnsupportedFeatureError(
            f"the {rule} rule at {site!r} rebuilds the site from the hooks it reads, but the "
            f"result differs from the site's value by {err:.3g} (allowed {bound:.3g} in "
            f"{value.dtype}): this driver or model computes the site differently (another "
            f"activation than ModelInfo.act_fn, another norm layout). Turn the rule off in "
            f"RelevanceRules for this model."
        )


# -- planning ---------------------------------------------------------------------------


@dataclass
class _Plan:
    """One site's row, and what to install there."""

    row: SiteCoverage
    key: str
    make: Callable[[dict[str, _Tap]], _Replacing] | None = None


def _model_parts(model: Any) -> tuple[ModelInfo, dict[str, HookPoint], Any]:
    driver = getattr(model, "driver", None)
    hook_dict = getattr(model, "hook_dict", None)
    if driver is None or hook_dict is None:
        raise UserError(
            f"use_relevance_rules takes a bridge (TransformerBridge), got "
            f"{type(model).__name__}; boot one with TransformerBridge.boot_native() or "
            f"TransformerBridge.boot_transformers()."
        )
    if not driver.supports("gradients"):
        raise UnsupportedFeatureError(
            f"use_relevance_rules changes the backward pass, and driver "
            f"{getattr(driver, 'name', '?')!r} has no gradients; boot the model on a local "
            f"driver with gradients (native, hf)."
        )
    return model.cfg, dict(hook_dict), model.namespace


def _norm_prefixes(info: ModelInfo, i: int) -> tuple[list[str], list[str]]:
    """Block ``i``'s norms before attention's pattern, and the rest."""
    before = [f"blocks.{i}.ln1"]
    if info.qk_norm:
        before += [f"blocks.{i}.attn.q_norm", f"blocks.{i}.attn.k_norm"]
    after = [f"blocks.{i}.ln1_post"] if info.sandwich_norm else []
    return before, after


def _plans(model: Any, rules: RelevanceRules) -> tuple[ModelInfo, list[_Plan], list[str]]:
    """Every site's row and install recipe, and the problems that forbid installing."""
    info, points, namespace = _model_parts(model)
    problems: list[str] = []

    def unavailable(site: str, reads: tuple[str, ...]) -> str | None:
        missing = [n for n in (site, *reads) if n not in points]
        if missing:
            why = "; ".join(f"{n}: {namespace.reasons.get(n, 'not served')}" for n in missing)
            return f"needs {', '.join(missing)}, which this model does not fire ({why})"
        if site not in namespace.editable:
            return f"cannot replace {site}: {namespace.reasons.get(site, 'the site is read-only')}"
        return None

    def norm(prefix: str) -> _Plan:
        site, reads = f"{prefix}.hook_normalized", (f"{prefix}.hook_in", f"{prefix}.hook_scale")
        if not rules.normalization:
            return _Plan(SiteCoverage(site, "LN", False, reads, "normalization rule off"), "off")
        if not any(
            f"{prefix}.{s}" in points for s in ("hook_scale", "hook_normalized", "hook_out")
        ):
            reason = namespace.reasons.get(site, "this model has no such norm")
            return _Plan(SiteCoverage(site, "LN", False, reads, f"no norm here: {reason}"), "")
        problem = unavailable(site, reads)
        if problem:
            problems.append(f"LN rule at {site}: {problem}; {_WITHOUT['normalization']}")
        centre = info.normalization_type == "LN"

        def make(taps: dict[str, _Tap]) -> _Replacing:
            return _NormRule(tuple((n, taps[n]) for n in reads), centre=centre)

        return _Plan(SiteCoverage(site, "LN", True, reads), f"LN:{info.normalization_type}", make)

    def mlp(i: int) -> _Plan:
        p = f"blocks.{i}.mlp."
        site = p + "hook_post"
        gated = info.gated_mlp
        reads = (p + "hook_pre", p + "hook_pre_linear") if gated else (p + "hook_pre",)
        identity, half = rules.activation, rules.multiplicative_gate and gated
        rule: RuleName = "Identity+Half" if identity and half else "Half" if half else "Identity"
        if not identity and not half:
            why = "activation rule off" + (" and multiplicative-gate rule off" if gated else "")
            return _Plan(SiteCoverage(site, rule, False, reads, why), "off")
        problem = unavailable(site, reads)
        if problem:
            without = _WITHOUT["gated" if gated else "activation"]
            problems.append(f"{rule} rule at {site}: {problem}; {without}")
        # Unknown names never get installed: _activation_problems refuses them first.
        act = _ACTIVATIONS.get(info.act_fn or "", F.relu)

        def make(taps: dict[str, _Tap]) -> _Replacing:
            named = tuple((n, taps[n]) for n in reads)
            return _MlpRule(named, act=act, identity=identity, half=half, rule=rule)

        return _Plan(SiteCoverage(site, rule, True, reads), f"{rule}:{info.act_fn}", make)

    def pattern(i: int) -> _Plan:
        site = f"blocks.{i}.attn.hook_pattern"
        if not rules.attention:
            return _Plan(SiteCoverage(site, "attention", False, (), "attention rule off"), "off")
        problem = unavailable(site, ())
        if problem:
            problems.append(f"attention rule at {site}: {problem}; {_WITHOUT['attention']}")
        return _Plan(
            SiteCoverage(site, "attention", True), "attention", lambda taps: _PatternRule()
        )

    has_norm = info.normalization_type in ("LN", "RMS")
    plans: list[_Plan] = [norm("embed_ln")] if has_norm and info.embed_norm else []
    for i in range(info.n_layers):
        before, after = _norm_prefixes(info, i) if has_norm else ([], [])
        plans += [norm(prefix) for prefix in before]
        plans.append(pattern(i))
        plans += [norm(prefix) for prefix in after]
        if has_norm:
            plans.append(norm(f"blocks.{i}.ln2"))
        plans.append(mlp(i))
        if has_norm and info.sandwich_norm:
            plans.append(norm(f"blocks.{i}.ln2_post"))
    if has_norm:
        plans.append(norm("ln_final"))
    if any(p.make is not None and p.row.site.endswith("mlp.hook_post") for p in plans):
        problems[:0] = _activation_problems(info, rules)
    return info, plans, problems


def _activation_problems(info: ModelInfo, rules: RelevanceRules) -> list[str]:
    act = info.act_fn
    off = _WITHOUT["gated" if info.gated_mlp else "activation"]
    if act is None:
        return [
            f"the MLP rules need the activation function, and the driver reports none "
            f"(ModelInfo.act_fn is None for {info.architecture!r}); {off}"
        ]
    if rules.activation and act in _RELU_FAMILY:
        fix = (
            "RelevanceRules(activation=False) (the Half rule alone still applies)"
            if info.gated_mlp
            else "RelevanceRules(activation=False)"
        )
        return [
            f"the Identity rule is for smooth activations whose f(x)/x tends to 1/2 at 0 "
            f"(GELU, SiLU), and {info.architecture!r} uses the ReLU-family {act!r} (f(x)/x "
            f"jumps at 0, and for ReLU it already is the gradient); pass {fix}"
        ]
    if act not in _ACTIVATIONS:
        return [
            f"the MLP rules do not know the activation {act!r} of {info.architecture!r} "
            f"(known: {', '.join(sorted(_ACTIVATIONS))}); {off}"
        ]
    return []


# -- installing ------------------------------------------------------------------------


@dataclass
class _Active:
    """A rule (or an explicit "off") held at one site by one or more nested scopes."""

    key: str
    count: int = 0
    handles: list[HookHandle] = field(default_factory=list)


_ACTIVE: weakref.WeakKeyDictionary[HookPoint, _Active] = weakref.WeakKeyDictionary()


def _refusal(row: SiteCoverage) -> str:
    reads = ", ".join(row.reads)
    inputs = f" (its inputs {reads} may be edited)" if reads else ""
    return (
        f"the {row.rule} relevance rule owns this value's backward pass inside "
        f"use_relevance_rules(...), and an edit here would bypass it; edit outside the "
        f"with-block, or edit another site{inputs}"
    )


def _install(plan: _Plan, model: Any, points: dict[str, HookPoint]) -> list[HookHandle]:
    if plan.make is None:
        return []
    taps = {name: _Tap() for name in plan.row.reads}
    handles = [points[name].add_hook(tap) for name, tap in taps.items()]
    point = points[plan.row.site]
    rule = plan.make(taps)

    def unreachable(site: str) -> str | None:
        namespace = model.namespace
        return None if site in namespace.editable else namespace.reasons.get(site, "read-only")

    rule.unreachable = unreachable
    handles.append(point.add_hook(rule))
    point.edit_refusal = _refusal(plan.row)
    return handles


def _release(point: HookPoint) -> None:
    active = _ACTIVE.get(point)
    if active is None:
        return
    active.count -= 1
    if active.count > 0:
        return
    for handle in active.handles:
        handle.remove()
    if active.handles:
        point.edit_refusal = None
    del _ACTIVE[point]


@contextmanager
def use_relevance_rules(
    model: Any, rules: RelevanceRules = RelevanceRules()
) -> Iterator[RelevanceCoverage]:
    """Swap LRP rules into the model's backward pass for the duration of a ``with`` block.

    Gradients (``.backward()``, ``attribution_patch``, ``run_with_cache(incl_bwd=True)``)
    follow the rules, which turns attribution patching into Relevance Patching (RelP). Every
    ruled site hands on its own value bit for bit, so the forward equals the forward with the
    same sites read by a hook. Against an unhooked forward two float-rounding differences
    (~1e-6) remain, both the driver's: the attention rule needs the materialised pattern, so
    attention runs its explicit path instead of a fused kernel; and the hf driver rebuilds a
    LayerNorm's output from ``hook_normalized`` once that value is replaced (RMSNorm
    rebuilds are exact). ``RelevanceRules(attention=False)`` on the native driver or an
    RMSNorm hf model keeps the unhooked forward's bits.

    Nested scopes with the same rules share the installed hooks (the outermost exit removes
    them); a nested scope asking for a different rule at any site raises. While a rule is
    active at a site, a hook or intervention spec that edits that site raises ``UserError``;
    hooks that only read (caches, backward hooks) stay allowed.

    Args:
        model: A ``TransformerBridge`` on a driver with gradients.
        rules: Which rules to apply (default: all four).

    Yields:
        The coverage report: per site, installed or skipped with the reason.

    Raises:
        UnsupportedFeatureError: The driver has no gradients, or a requested rule cannot be
            honoured somewhere (a ReLU-family or unknown activation for the Identity rule,
            hooks the rule needs that the model does not fire, a site that cannot be
            edited), before any hook is installed.
        UserError: ``rules`` is not a ``RelevanceRules``, or an enclosing scope holds a
            different rule at one of the sites.
    """
    if not isinstance(rules, RelevanceRules):
        raise UserError(
            f"use_relevance_rules takes rules=RelevanceRules(...), got {type(rules).__name__}."
        )
    info, plans, problems = _plans(model, rules)
    if problems:
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise UnsupportedFeatureError(
            f"cannot apply {rules} to {info.architecture or 'this model'!r}; nothing was "
            f"installed:\n  {shown}{more}"
        )
    points = dict(model.hook_dict)
    held = [(plan, points[plan.row.site]) for plan in plans if plan.key and plan.row.site in points]
    conflicts = [
        f"{plan.row.site}: active {active.key!r}, asked {plan.key!r}"
        for plan, point in held
        if (active := _ACTIVE.get(point)) is not None and active.key != plan.key
    ]
    if conflicts:
        raise UserError(
            f"an enclosing use_relevance_rules scope holds other rules on this model at "
            f"{len(conflicts)} site(s) ({'; '.join(conflicts[:4])}); nested scopes must ask "
            f"for the same RelevanceRules. Exit the outer scope first, or reuse its rules."
        )
    entered: list[HookPoint] = []
    try:
        for plan, point in held:
            active = _ACTIVE.get(point)
            if active is None:
                active = _ACTIVE[point] = _Active(plan.key, handles=_install(plan, model, points))
            active.count += 1
            entered.append(point)
        yield RelevanceCoverage(
            rules, info.architecture, info.act_fn, tuple(plan.row for plan in plans)
        )
    finally:
        for point in reversed(entered):
            _release(point)
