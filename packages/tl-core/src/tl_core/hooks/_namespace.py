"""``HookNamespace``: the hook names of one booted model, as its driver serves them.

Every place that accepts a hook name (capture lists, ``intervene=`` specs, cache lookup,
``add_hook``) resolves it through the namespace of the model at hand, so one name means one
tensor everywhere on that model: ``blocks.0.hook_attn_out`` is the post-attention norm's
output on Gemma 2 for capture, for specs and for cache lookup alike, on every driver.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType

from tl_core._errors import DriverContractError, HookNameError, SpecError
from tl_core.hooks._dictionary_sites import DictionarySite, split_dictionary_name
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._order import forward_order
from tl_core.hooks._requirements import UNKNOWN_BECAUSE, requirement_unknown
from tl_core.hooks._resolution import (
    HookResolution,
    canonical_name,
    resolve_hook_name,
    suggest_names,
)
from tl_core.hooks._shapes import feature_shape
from tl_core.hooks._vocabulary import (
    CANONICAL_TEMPLATES,
    MISSING_BECAUSE,
    HookTemplate,
    requirement_met,
    split_canonical,
)

__all__ = ["HookNamespace"]

_SHOWN = 12
_IDS = ("b p", "b p k")  # token and position ids, chosen experts: integers
_IDS_REASON = (
    "it holds integer ids, which affine specs cannot edit (a Python hook on a local driver "
    "can replace them)"
)


def _sites(info: ModelInfo) -> Iterator[tuple[HookTemplate, list[str], ModelInfo]]:
    """Every template with its concrete names on ``info``, per stack for per-block ones."""
    for template in CANONICAL_TEMPLATES:
        if not template.per_block:
            yield template, [template.template], info
            continue
        for prefix, stack in info.stacks:
            yield template, [template.format(i, prefix) for i in range(stack.n_layers)], stack


@dataclass(frozen=True, eq=False)
class HookNamespace:
    """What each hook name means on one model, and what its driver can do there.

    Build it with ``HookNamespace.build``; drivers expose it as ``driver.namespace`` and
    bridges as ``bridge.namespace``.

    Attributes:
        info: The model's sizes and structure; names resolve against it.
        served: Canonical hooks the driver captures (and fires hooks at).
        editable: Served hooks that take intervention specs.
        reasons: Why each canonical hook of the vocabulary is not served (every one of them
            has an entry), and why each served hook is read-only.
        driver: The driver's name, for messages.
        dictionaries: Canonical site -> the dictionary attached there (its sites are served
            under the site's name; see ``with_dictionary``).
        eager_only: Served hooks that a compiled engine cannot serve inside its compiled
            graph, with why: a run that reads or edits one runs the engine's eager forward
            (slower, same values). Empty for drivers and engines that do not compile.
    """

    info: ModelInfo
    served: frozenset[str]
    editable: frozenset[str]
    reasons: Mapping[str, str] = field(default_factory=dict)
    driver: str = ""
    dictionaries: Mapping[str, DictionarySite] = field(default_factory=dict)
    eager_only: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        info: ModelInfo,
        served: Iterable[str],
        *,
        editable: Iterable[str] | None = None,
        read_only: Mapping[str, str] | None = None,
        reasons: Mapping[str, str] | None = None,
        driver: str = "",
        eager_only: Mapping[str, str] | None = None,
    ) -> HookNamespace:
        """The namespace of a model whose driver serves ``served``.

        Args:
            info: The model's sizes and structure.
            served: Canonical names the driver captures.
            editable: The served names that take specs (default: all of them but the
                integer sites, token and position ids and chosen experts).
            read_only: Served names that take no specs, with the reason (taken out of
                ``editable``).
            reasons: Why the driver cannot serve (or edit) particular hooks. Hooks the
                model structurally lacks get the structural reason; any other unserved
                hook without a reason gets a generic one naming the driver.
            driver: The driver's name, for messages.
            eager_only: Served names that run only in the engine's eager forward, with why
                (see the attribute).

        Returns:
            The namespace.

        Raises:
            DriverContractError: A served or editable name that is not canonical, names a
                block the model does not have, or an editable name that is not served.
        """
        if not isinstance(info, ModelInfo):
            raise DriverContractError(
                f"HookNamespace.build needs a ModelInfo, got {type(info).__name__}: {info!r}"
            )
        label = f"driver {driver!r}" if driver else "the driver"
        served_set = frozenset(served)
        _check_canonical(served_set, info, label, "serves")
        if editable is None:
            editable_set = frozenset(n for n in served_set if _template(n).layout not in _IDS)
        else:
            editable_set = frozenset(editable)
        editable_set -= frozenset(read_only or ())
        stray = editable_set - served_set
        if stray:
            raise DriverContractError(
                f"{label} declares hooks editable that it does not serve: {sorted(stray)[:5]}"
            )
        unserved = frozenset(eager_only or ()) - served_set
        if unserved:
            raise DriverContractError(
                f"{label} declares hooks eager-only that it does not serve: {sorted(unserved)[:5]}"
            )
        given = {**(reasons or {}), **(read_only or {})}
        model = info.architecture or "model"
        table: dict[str, str] = {}
        for template, names, stack in _sites(info):
            present = requirement_met(
                template.requires,
                stack,
                include_attn_result=False,
                include_split_qkv_input=False,
                statistic=template.statistic,
            )
            unknown = requirement_unknown(template.requires, stack, statistic=template.statistic)
            for name in names:
                if name in served_set and name in editable_set:
                    continue
                if name in given:
                    table[name] = given[name]
                elif name in served_set:
                    generic = f"{label} serves it for capture only"
                    table[name] = _IDS_REASON if template.layout in _IDS else generic
                elif not present and unknown is not None:
                    table[name] = f"this {model} may have such a site: {UNKNOWN_BECAUSE[unknown]}"
                elif not present and template.requires is not None:
                    table[name] = (
                        f"this {model} has no such site: {MISSING_BECAUSE[template.requires]}"
                    )
                else:
                    table[name] = f"{label} does not serve it"
        return cls(
            info, served_set, editable_set, MappingProxyType(table), driver,
            eager_only=MappingProxyType(dict(eager_only or {})),
        )  # fmt: skip

    def with_dictionary(self, site: DictionarySite) -> HookNamespace:
        """This namespace with a dictionary's sites served under ``site.hook``.

        Raises:
            HookNameError: The site or the output site is not served here, or not editable
                (the dictionary replaces its value), or a dictionary already reads or
                writes there.
        """
        for hook in dict.fromkeys((site.hook, site.output_hook)):
            if hook not in self.editable:
                served = "served read-only" if hook in self.served else "not served"
                raise HookNameError(
                    f"a dictionary cannot be attached at {hook!r}: {self._who} has it {served} "
                    f"({self.reasons.get(hook, 'no reason given')}); a dictionary replaces the "
                    "value of the site it writes, so both of its sites must be editable"
                )
            for other in self.dictionaries.values():
                if hook in (other.hook, other.output_hook):
                    raise HookNameError(
                        f"a dictionary already reads or writes {hook!r} (the one at "
                        f"{other.hook!r}); remove it first"
                    )
        return replace(
            self,
            served=self.served | frozenset(site.names),
            editable=self.editable | frozenset(site.editable),
            dictionaries=MappingProxyType({**self.dictionaries, site.hook: site}),
        )

    def without_dictionary(self, hook: str) -> HookNamespace:
        """This namespace without the dictionary at canonical ``hook`` (and its sites)."""
        site = self.dictionaries.get(hook)
        if site is None:
            return self
        names = frozenset(site.names)
        rest = {k: v for k, v in self.dictionaries.items() if k != hook}
        return replace(
            self,
            served=self.served - names,
            editable=self.editable - names,
            dictionaries=MappingProxyType(rest),
        )

    # -- sets -------------------------------------------------------------------------

    @property
    def non_fireable(self) -> frozenset[str]:
        """Canonical hooks of this model's depth that the driver does not serve."""
        return frozenset(n for n in self.reasons if n not in self.served)

    @property
    def non_fireable_reasons(self) -> dict[str, str]:
        """Why the driver cannot fire each hook it does not serve."""
        return {n: r for n, r in self.reasons.items() if n not in self.served}

    @property
    def read_only(self) -> frozenset[str]:
        """Served hooks that take no specs."""
        return self.served - self.editable

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` (canonical or alias) is a hook the driver serves."""
        if not isinstance(name, str):
            return False
        try:
            return self.canonical(name) in self.served
        except HookNameError:
            return False

    def __iter__(self) -> Iterator[str]:
        """The served hooks, in forward order."""
        return iter(self.ordered)

    def __len__(self) -> int:
        return len(self.served)

    @cached_property
    def ordered(self) -> tuple[str, ...]:
        """The served hooks, in the order the forward pass reaches them."""
        return tuple(forward_order(self.served))

    # -- names ------------------------------------------------------------------------

    def resolve(self, name: str) -> HookResolution:
        """What ``name`` means on this model (see ``tl_core.resolve_hook_name``).

        Raises:
            HookNameError: Unknown or malformed names, block indices out of range.
        """
        return resolve_hook_name(name, info=self.info)

    def canonical(self, name: str) -> str:
        """The canonical site ``name`` denotes on this model, served or not.

        Raises:
            HookNameError: Unknown names, and names that denote no site here (derived,
                reconstructed or structurally absent; the message says why), and dictionary
                sites under a hook without a dictionary.
        """
        split = split_dictionary_name(name)
        if split is None:
            return canonical_name(name, info=self.info)
        base, site = split
        hook = canonical_name(base, info=self.info)
        if hook not in self.dictionaries:
            attached = ", ".join(sorted(self.dictionaries)) or "none"
            raise HookNameError(
                f"{name!r} is a dictionary site, but no dictionary is attached at {hook!r} "
                f"(attached at: {attached}); attach one first with "
                f"bridge.add_sae(dictionary, hook_name={hook!r})"
            )
        return f"{hook}.{site}"

    def lookup(self, name: str, *, edit: bool = False) -> str:
        """The canonical name of ``name`` if the driver serves it (and can edit it).

        Args:
            name: Any accepted hook name.
            edit: Also require that specs can edit the hook.

        Returns:
            The canonical name.

        Raises:
            HookNameError: The name is unknown, denotes no site of this model, or the driver
                cannot fire it (with the driver's reason or the nearest served names).
            SpecError: ``edit`` and the hook is served read-only (with the reason and the
                nearest editable hooks).
        """
        if not isinstance(name, str):
            raise HookNameError(f"hook names are strings, got {type(name).__name__}: {name!r}")
        canonical = self.canonical(name)
        shown = repr(name) if name == canonical else f"{name!r} ({canonical!r})"
        if canonical in self.served:
            if not edit or canonical in self.editable:
                return canonical
            raise SpecError(
                f"intervention on {shown}: {self._who} cannot edit it: "
                f"{self.reasons.get(canonical, 'it is served read-only')}. "
                f"{self._nearest(canonical, self.editable, 'Hooks it can edit')}"
            )
        reason = self.reasons.get(canonical)
        if reason is not None and split_canonical(canonical) is not None:
            raise HookNameError(f"{self._who} cannot fire {shown}: {reason}")
        raise HookNameError(
            f"{self._who} does not serve {shown} on this {self.info.architecture or 'model'} "
            f"with {self.info.n_layers} blocks. {self._nearest(canonical, self.served, 'Served hooks')}"
        )

    def _nearest(self, name: str, pool: frozenset[str], what: str) -> str:
        close = suggest_names(name, pool)
        if close:
            return f"Did you mean {', '.join(repr(c) for c in close)}?"
        shown = forward_order(pool)[:_SHOWN]
        more = f" (+{len(pool) - _SHOWN} more)" if len(pool) > _SHOWN else ""
        return f"{what}: {', '.join(shown) or 'none'}{more}."

    @property
    def _who(self) -> str:
        return f"driver {self.driver!r}" if self.driver else "this driver"

    # -- shapes -----------------------------------------------------------------------

    def layout(self, hook: str) -> str:
        """The tensor layout of canonical ``hook`` (``"b p h dh"``, ...)."""
        found = self._dictionary_site(hook)
        if found is not None:
            return found[0].layout(found[1])
        return _template(hook).layout

    def feature_shape(self, hook: str) -> tuple[int, ...] | None:
        """Per-position shape of canonical ``hook``; ``None`` for patterns and scores."""
        found = self._dictionary_site(hook)
        if found is not None:
            return found[0].feature_shape(found[1])
        return feature_shape(hook, self.layout(hook), self.info)

    def _dictionary_site(self, hook: str) -> tuple[DictionarySite, str] | None:
        split = split_dictionary_name(hook) if self.dictionaries else None
        if split is None or split[0] not in self.dictionaries:
            return None
        return self.dictionaries[split[0]], split[1]

    def __repr__(self) -> str:
        return (
            f"HookNamespace(driver={self.driver!r}, arch={self.info.architecture!r}, "
            f"served={len(self.served)}, editable={len(self.editable)}, "
            f"non_fireable={len(self.non_fireable)})"
        )


def _template(hook: str) -> HookTemplate:
    split = split_canonical(hook)
    if split is None:
        raise HookNameError(f"{hook!r} is not a canonical hook name")
    return split[0]


def _check_canonical(names: frozenset[str], info: ModelInfo, label: str, verb: str) -> None:
    for name in sorted(names):
        split = split_canonical(name) if isinstance(name, str) else None
        if split is None:
            raise DriverContractError(
                f"{label} {verb} {name!r}, which is not a canonical hook name; list canonical "
                f"names (tl_core.canonical_hook_names(info))."
            )
        layer = split[1]
        if layer is None:
            continue
        prefix = name.split(".", 1)[0]
        stacks = dict(info.stacks)
        if prefix not in stacks:
            raise DriverContractError(
                f"{label} {verb} {name!r}, but the model's blocks are named "
                f"{' and '.join(f'{p}.{{i}}' for p in stacks)}."
            )
        if layer >= stacks[prefix].n_layers:
            raise DriverContractError(
                f"{label} {verb} {name!r}, but the model has {stacks[prefix].n_layers} blocks "
                f"in {prefix}."
            )
