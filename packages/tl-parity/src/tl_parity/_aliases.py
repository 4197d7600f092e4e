"""Alias reports: every name of another tool's naming generation, and what it is here.

A user arriving from TransformerLens, nnterp or interp-engine brings that tool's names.
``alias_report`` lists every concrete name of one generation for the booted model (all
block indices expanded) and says, honestly, what tl does with it on this model and driver:

* ``real``: the name denotes a canonical site this driver fires (capture and, where
  editable, intervene).
* ``derived``: no site of its own; computed from canonical sites (a broadcast, a softmax).
* ``reconstructed_read_only``: a real value of the model that no tl hook fires at; it can
  be rebuilt after the pass from captured sites and the weights, never intervened on.
* ``needs_capture``: an opt-in site (``attn.hook_result``, the per-head q/k/v inputs) that
  fires only once turned on; the reason says how.
* ``not_served``: a site the model has that this driver cannot fire (the driver's reason).
* ``structurally_absent``: a site this model does not have, with the reason.

The names come from tl-core's alias tables, so the report and name resolution always agree
on what a name means; ``resolve_hook_name`` decides each row against the model's
``ModelInfo``, and the driver's ``HookNamespace`` decides what is served.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tl_core.driver_api import known_alias_templates
from tl_core.hooks import (
    CANONICAL_TEMPLATES,
    HookNamespace,
    canonical_hook_names,
    resolve_hook_name,
)

__all__ = [
    "ALIAS_STATUSES",
    "GENERATIONS",
    "AliasReport",
    "AliasRow",
    "AliasStatus",
    "Generation",
    "alias_report",
    "alias_reports",
    "check_generation",
]

AliasStatus = Literal[
    "real",
    "derived",
    "reconstructed_read_only",
    "needs_capture",
    "not_served",
    "structurally_absent",
]

#: Every status, in the order reports count them.
ALIAS_STATUSES: tuple[AliasStatus, ...] = (
    "real",
    "derived",
    "reconstructed_read_only",
    "needs_capture",
    "not_served",
    "structurally_absent",
)

Generation = Literal["transformer_lens_2", "transformer_lens_4", "nnterp", "interp_engine"]

#: The naming generations a report can cover, with what each one is.
GENERATIONS: Mapping[Generation, str] = {
    "transformer_lens_2": "TransformerLens 2.x/3.x HookedTransformer hook names",
    "transformer_lens_4": "TransformerLens 4.x TransformerBridge hook names",
    "nnterp": "nnterp StandardizedTransformer accessor names",
    "interp_engine": "interp-engine 1.14.3 point addresses",
}

# tl-core's family names for the same generations, accepted as synonyms.
_SYNONYMS: Mapping[str, Generation] = {
    "legacy": "transformer_lens_2",
    "hooked_transformer": "transformer_lens_2",
    "tl_bridge": "transformer_lens_4",
    "transformer_bridge": "transformer_lens_4",
}

_OPT_IN_HOW = {
    "attn.hook_result": "per-head results are opt-in: boot with use_attn_result=True",
    "attn.hook_q_input": "per-head query inputs are opt-in: call "
    "model.set_use_split_qkv_input(True) (local drivers)",
    "attn.hook_k_input": "per-head key inputs are opt-in: call "
    "model.set_use_split_qkv_input(True) (local drivers)",
    "attn.hook_v_input": "per-head value inputs are opt-in: call "
    "model.set_use_split_qkv_input(True) (local drivers)",
}


@dataclass(frozen=True)
class AliasRow:
    """One name of a generation and what it is on the booted model.

    Attributes:
        name: The concrete name as the other tool spells it (``"resid_post.1"``).
        status: One of ``ALIAS_STATUSES``.
        canonical: The canonical site it denotes (for ``derived`` and
            ``reconstructed_read_only``: the site it is computed from, if one); ``None`` for
            ``structurally_absent`` rows and values computed from no single site.
        reason: Why the status holds (how to compute or turn on the value, why the site is
            absent, or how the other tool's layout differs); empty when nothing needs saying.
    """

    name: str
    status: AliasStatus
    canonical: str | None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "name": self.name,
            "status": self.status,
            "canonical": self.canonical,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class AliasReport:
    """Every name of one naming generation on one booted model.

    Attributes:
        generation: Which generation (a key of ``GENERATIONS``).
        model: The model's architecture as its driver reports it.
        driver: The driver's name.
        n_layers: Blocks of the model (per-block names are listed for each).
        rows: One row per concrete name, global names first, then block by block.
    """

    generation: Generation
    model: str
    driver: str
    n_layers: int
    rows: tuple[AliasRow, ...] = field(default_factory=tuple)

    @property
    def counts(self) -> dict[AliasStatus, int]:
        """Rows per status, every status present (zero included)."""
        out: dict[AliasStatus, int] = dict.fromkeys(ALIAS_STATUSES, 0)
        for row in self.rows:
            out[row.status] += 1
        return out

    def by_name(self) -> dict[str, AliasRow]:
        """The rows keyed by name."""
        return {row.name: row for row in self.rows}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: metadata, counts and every row."""
        return {
            "generation": self.generation,
            "description": GENERATIONS[self.generation],
            "model": self.model,
            "driver": self.driver,
            "n_layers": self.n_layers,
            "counts": dict(self.counts),
            "rows": [row.to_dict() for row in self.rows],
        }

    def __str__(self) -> str:
        """A terminal table: a header with the counts, then one line per name."""
        counts = ", ".join(f"{s} {n}" for s, n in self.counts.items() if n)
        head = (
            f"{GENERATIONS[self.generation]} on {self.model or 'model'} "
            f"({self.n_layers} blocks, driver {self.driver or '?'}): "
            f"{len(self.rows)} names: {counts}"
        )
        cells = [(r.name, r.status, r.canonical or "-", _clip(r.reason)) for r in self.rows]
        titles = ("name", "status", "canonical", "reason")
        widths = [max([len(t)] + [len(c[k]) for c in cells]) for k, t in enumerate(titles[:3])]
        lines = [
            head,
            _line(titles, widths),
            _line((*tuple("-" * w for w in widths), "-" * 6), widths),
        ]
        lines += [_line(c, widths) for c in cells]
        return "\n".join(lines)


def _clip(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _line(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells[:3], widths, strict=True)) + "  " + cells[3]


def check_generation(generation: str) -> Generation:
    """The generation ``generation`` names (a key of ``GENERATIONS`` or a synonym of one).

    Raises:
        ValueError: An unknown name; the message lists the choices and the closest one.
    """
    return _generation(generation)


def _generation(generation: str) -> Generation:
    key = _SYNONYMS.get(generation, generation)
    if key not in GENERATIONS:
        import difflib

        names = [*GENERATIONS, *_SYNONYMS]
        close = difflib.get_close_matches(generation, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown naming generation {generation!r}; {hint}expected one of {', '.join(names)}"
        )
    return key  # type: ignore[return-value]


def _templates(generation: Generation) -> list[str]:
    """The generation's name templates (``{i}`` = block index), in the tables' order."""
    table = known_alias_templates()
    if generation == "transformer_lens_2":
        # HookedTransformer names that tl adopted unchanged are canonical rows of the table.
        same = {t.template for t in CANONICAL_TEMPLATES if t.legacy == t.template}
        return [k for k, (fam, _, _) in table.items() if fam == "legacy" or k in same]
    if generation == "transformer_lens_4":
        # tl's canonical vocabulary is the bridge's naming, plus its module-level names.
        return [k for k, (fam, _, _) in table.items() if fam in ("canonical", "tl_bridge")]
    return [k for k, (fam, _, _) in table.items() if fam == generation]


def _namespace(bridge: Any) -> HookNamespace:
    namespace = bridge if isinstance(bridge, HookNamespace) else getattr(bridge, "namespace", None)
    if not isinstance(namespace, HookNamespace):
        raise TypeError(
            f"alias_report needs a booted bridge or driver (with .namespace) or a HookNamespace, "
            f"got {type(bridge).__name__}"
        )
    return namespace


def alias_report(bridge: Any, generation: str = "interp_engine") -> AliasReport:
    """List every name of ``generation`` for the booted model, each with its honest status.

    Args:
        bridge: A booted ``TransformerBridge``/``RemoteBridge``, a driver, or its
            ``HookNamespace``: anything with the model's namespace.
        generation: A key of ``GENERATIONS`` (``"transformer_lens_2"``,
            ``"transformer_lens_4"``, ``"nnterp"``, ``"interp_engine"``), or tl-core's family
            name for it (``"legacy"``, ``"tl_bridge"``).

    Returns:
        The report: one row per concrete name (per-block names for every block).

    Raises:
        ValueError: An unknown generation.
        TypeError: ``bridge`` carries no ``HookNamespace``.
    """
    gen = _generation(generation)
    namespace = _namespace(bridge)
    info = namespace.info
    present = set(canonical_hook_names(info))
    opt_in = (
        set(canonical_hook_names(info, include_attn_result=True, include_split_qkv_input=True))
        - present
    )
    templates = _templates(gen)
    names = [t for t in templates if "{i}" not in t]
    names += [
        t.replace("{i}", str(layer))
        for layer in range(info.n_layers)
        for t in templates
        if "{i}" in t
    ]
    rows = tuple(_row(name, namespace, present, opt_in) for name in names)
    return AliasReport(gen, info.architecture, namespace.driver, info.n_layers, rows)


def alias_reports(
    bridge: Any, generations: Iterable[str] | None = None
) -> dict[Generation, AliasReport]:
    """``alias_report`` for several generations (default: all of ``GENERATIONS``).

    Args:
        bridge: As for ``alias_report``.
        generations: Which generations; every one when ``None``.

    Returns:
        ``{generation: report}`` in the order asked.
    """
    chosen = list(GENERATIONS) if generations is None else [_generation(g) for g in generations]
    return {g: alias_report(bridge, g) for g in chosen}


def _row(name: str, namespace: HookNamespace, present: set[str], opt_in: set[str]) -> AliasRow:
    resolution = resolve_hook_name(name, info=namespace.info)
    canonical, note = resolution.canonical, resolution.note
    if resolution.status == "structurally_absent":
        return AliasRow(name, "structurally_absent", None, note)
    if resolution.status in ("derived", "reconstructed_read_only"):
        if canonical is not None and canonical not in present and canonical not in opt_in:
            # Computed from a site this model does not have (rotary table on GPT-2, ...).
            why = namespace.reasons.get(canonical, f"this model has no {canonical!r}")
            return AliasRow(
                name,
                "structurally_absent",
                None,
                f"It would be computed from {canonical!r}, which is absent: {why}. {note}".strip(),
            )
        return AliasRow(name, resolution.status, canonical, note)
    assert canonical is not None  # canonical and alias resolutions always name their site
    if canonical in namespace.served:  # opt-in sites too, once the driver turned them on
        return AliasRow(name, "real", canonical, note)
    if canonical in opt_in:
        suffix = canonical.split(".", 2)[-1] if canonical.startswith("blocks.") else canonical
        how = _OPT_IN_HOW.get(suffix, "an opt-in site")
        return AliasRow(name, "needs_capture", canonical, _join(f"Opt-in site: {how}.", note))
    reason = namespace.reasons.get(canonical, f"driver {namespace.driver!r} does not serve it")
    return AliasRow(name, "not_served", canonical, _join(reason + ".", note))


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)
