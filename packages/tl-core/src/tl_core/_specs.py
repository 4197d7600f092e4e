"""Intervention specs: the one schema, validator and parser every driver uses.

A spec is plain data (``{"op": "scale", "factor": 0.5, "pos": [3]}``) that compiles to an
affine edit ``x * scale + bias`` (see ``tl_core._affine``). ``parse_spec`` checks one spec's
structure; ``build_plan`` checks a whole ``intervene=`` argument against a driver and a
batch (hook names, fireability, widths, positions) before any model work starts.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

from tl_core._errors import SpecError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "SPEC_JSON_SCHEMA",
    "SPEC_KEYS",
    "SPEC_OPS",
    "InterventionPlan",
    "InterventionSpec",
    "SpecLike",
    "SpecValue",
    "SpecValueLike",
    "build_plan",
    "parse_spec",
]

SpecOp: TypeAlias = Literal["suppress", "scale", "add", "set"]
SPEC_OPS: tuple[SpecOp, ...] = ("suppress", "scale", "add", "set")
"""The spec operations, in documentation order."""

SPEC_KEYS: tuple[str, ...] = ("op", "factor", "value", "pos")
"""Every key a spec mapping may hold."""

_OP_KEYS: dict[str, tuple[str, ...]] = {
    "suppress": ("op", "pos"),
    "scale": ("op", "factor", "pos"),
    "add": ("op", "value", "pos"),
    "set": ("op", "value", "pos"),
}

SpecValue: TypeAlias = "float | tuple[float, ...] | tuple[tuple[float, ...], ...]"
"""A normalised ``value``: a scalar, one flat vector, or one flat vector per position."""

SpecValueLike: TypeAlias = (
    "float | Sequence[float] | Sequence[Sequence[float]] | torch.Tensor | np.ndarray[Any, Any]"
)
"""What ``value`` may be given as; tensors and arrays are converted to tuples."""

_NUMBER = {"type": "number"}
_VECTOR = {"type": "array", "items": _NUMBER, "minItems": 1}
_POS = {
    "oneOf": [
        {"type": "integer"},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "uniqueItems": True},
    ],
    "description": "Sequence positions to edit (negative counts from the prompt's end); "
    "absent means every position.",
}
_VALUE = {
    "oneOf": [
        _NUMBER,
        _VECTOR,
        {"type": "array", "items": _VECTOR, "minItems": 1},
    ],
    "description": "A scalar, a flat vector of the hook's feature width, or one such "
    "vector per listed position (then 'pos' is required).",
}
_PER_POSITION_NEEDS_POS = {
    "if": {
        "properties": {"value": {"type": "array", "items": {"type": "array"}}},
        "required": ["value"],
    },
    "then": {"required": ["pos"]},
}


def _op_schema(op: str, description: str, extra: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "description": description,
        "properties": {"op": {"const": op}, **extra, "pos": {"$ref": "#/$defs/pos"}},
        "required": ["op", *extra],
        "additionalProperties": False,
    }
    if "value" in extra:
        schema.update(_PER_POSITION_NEEDS_POS)
    return schema


SPEC_JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tl intervention spec",
    "description": "One edit of the activation at a hook, compiled to x * scale + bias. "
    "A list of specs on one hook composes in order.",
    "oneOf": [
        _op_schema("suppress", "x -> 0", {}),
        _op_schema("scale", "x -> factor * x", {"factor": _NUMBER}),
        _op_schema("add", "x -> x + value", {"value": {"$ref": "#/$defs/value"}}),
        _op_schema("set", "x -> value", {"value": {"$ref": "#/$defs/value"}}),
    ],
    "$defs": {"pos": _POS, "value": _VALUE},
}
"""The published JSON Schema (draft 2020-12) of one spec object."""


@dataclass(frozen=True)
class InterventionSpec:
    """One declarative edit of a hook's activation.

    Construct with the class methods (``InterventionSpec.scale(0.5, pos=[3])``), from a
    mapping with ``parse_spec``, or directly; every route validates and normalises the
    fields (numbers become floats, vectors tuples, a single position a 1-tuple).

    Attributes:
        op: ``"suppress"`` (x -> 0), ``"scale"`` (x -> factor * x), ``"add"``
            (x -> x + value) or ``"set"`` (x -> value).
        factor: The multiplier; ``scale`` only.
        value: ``add``/``set`` only: a scalar, a flat vector of the hook's feature width,
            or one such vector per position listed in ``pos``.
        pos: Sequence positions to edit (negative ones count from the prompt's end);
            ``None`` edits every position.
    """

    op: SpecOp
    factor: float | None = None
    value: SpecValue | None = None
    pos: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        fields = {"op": self.op, "factor": self.factor, "value": self.value, "pos": self.pos}
        normalised = _normalise(
            {k: v for k, v in fields.items() if v is not None}, "InterventionSpec"
        )
        for name in ("factor", "value", "pos"):
            object.__setattr__(self, name, getattr(normalised, name))

    @classmethod
    def suppress(cls, pos: int | Sequence[int] | None = None) -> InterventionSpec:
        """``x -> 0`` at ``pos`` (every position when ``None``)."""
        return cls("suppress", pos=cast(Any, pos))

    @classmethod
    def scale(cls, factor: float, pos: int | Sequence[int] | None = None) -> InterventionSpec:
        """``x -> factor * x`` at ``pos`` (every position when ``None``)."""
        return cls("scale", factor=factor, pos=cast(Any, pos))

    @classmethod
    def add(cls, value: SpecValueLike, pos: int | Sequence[int] | None = None) -> InterventionSpec:
        """``x -> x + value`` at ``pos`` (every position when ``None``)."""
        return cls("add", value=cast(Any, value), pos=cast(Any, pos))

    @classmethod
    def set(cls, value: SpecValueLike, pos: int | Sequence[int] | None = None) -> InterventionSpec:
        """``x -> value`` at ``pos`` (every position when ``None``)."""
        return cls("set", value=cast(Any, value), pos=cast(Any, pos))

    @property
    def has_per_position_value(self) -> bool:
        """Whether ``value`` holds one vector per listed position."""
        return (
            isinstance(self.value, tuple) and bool(self.value) and isinstance(self.value[0], tuple)
        )

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-serialisable data that ``parse_spec`` reads back unchanged.

        Returns:
            A dict with ``op`` and only the keys the op uses; vectors become lists.
        """
        out: dict[str, Any] = {"op": self.op}
        if self.factor is not None:
            out["factor"] = self.factor
        if self.value is not None:
            out["value"] = _to_lists(self.value)
        if self.pos is not None:
            out["pos"] = list(self.pos)
        return out


SpecLike: TypeAlias = "InterventionSpec | Mapping[str, Any]"


def parse_spec(raw: object, *, hook: str) -> InterventionSpec:
    """Validate the structure of one spec and return it normalised.

    Widths and position ranges depend on the model and the prompt; ``build_plan`` checks
    those.

    Args:
        raw: A mapping such as ``{"op": "add", "value": [0.1, 0.2], "pos": -1}`` or an
            ``InterventionSpec``. Values may be numbers, (nested) lists, tensors or arrays.
        hook: The hook name the spec is for; every error message names it.

    Returns:
        The spec as an ``InterventionSpec``.

    Raises:
        SpecError: If the spec is not a mapping, has an unknown or missing key, an unknown
            op, or a key whose value has the wrong type or form.
    """
    return _parse(raw, f"intervention on {hook!r}")


@dataclass(frozen=True)
class InterventionPlan:
    """A validated ``intervene=`` argument for one batch, ready for a driver to apply.

    Attributes:
        per_prompt: One mapping per prompt: canonical hook name -> specs, applied in order.
            Positions are absolute (negative positions already resolved per prompt).
        callables: Canonical hook name -> Python hook functions ``fn(tensor, hook=...)``
            applied to every prompt (local drivers only). On a hook with both, drivers
            apply the specs first.
        lengths: The real (unpadded) length of each prompt, when known.
    """

    per_prompt: tuple[Mapping[str, tuple[InterventionSpec, ...]], ...]
    callables: Mapping[str, tuple[Callable[..., Any], ...]] = field(default_factory=dict)
    lengths: tuple[int, ...] | None = None

    @property
    def hooks(self) -> frozenset[str]:
        """Every canonical hook touched by a spec or a callable."""
        names = {name for mapping in self.per_prompt for name, specs in mapping.items() if specs}
        names.update(name for name, fns in self.callables.items() if fns)
        return frozenset(names)

    @property
    def is_empty(self) -> bool:
        """Whether the plan changes nothing."""
        return not self.hooks

    def specs_for(self, hook: str) -> tuple[tuple[InterventionSpec, ...], ...]:
        """The specs on one canonical hook, one tuple per prompt (empty where none).

        Args:
            hook: A canonical hook name.

        Returns:
            A tuple with one entry per prompt.
        """
        return tuple(mapping.get(hook, ()) for mapping in self.per_prompt)


def build_plan(
    intervene: object,
    *,
    lengths: Sequence[int],
    resolve_name: Callable[[str], str],
    fireable: Callable[[str], bool] | Collection[str],
    feature_shape: Callable[[str], tuple[int, ...] | None],
    allow_callables: bool,
) -> InterventionPlan:
    """Validate a whole ``intervene=`` argument against a driver and a batch.

    Args:
        intervene: ``None``; a mapping ``hook -> spec | [spec, ...] | callable`` applied to
            every prompt; or a sequence with one such mapping (or ``None``) per prompt.
            Two spellings of one hook (alias and canonical) merge in the order given.
        lengths: The real (unpadded) length of each prompt; the batch size is its length.
        resolve_name: Maps a user's hook name (aliases included) to its canonical name;
            raises ``HookNameError`` for unknown names.
        fireable: Whether the driver can apply an edit at a canonical hook: a predicate
            or a collection of names. A collection (or a bound ``__contains__`` of one)
            also lets errors suggest the nearest hook the driver can edit.
        feature_shape: The trailing feature shape of a canonical hook, e.g. ``(d_model,)``
            or ``(n_heads, d_head)``; ``None`` when the width is the prompt's length
            (attention scores and patterns, whose feature axis is the key position).
        allow_callables: Whether the driver accepts Python hook functions.

    Returns:
        The plan, with canonical names and absolute positions.

    Raises:
        SpecError: On any malformed spec, a spec on a hook the driver cannot edit, a wrong
            width or position, a callable the driver cannot run, or a per-prompt list whose
            length is not the batch size.
        HookNameError: From ``resolve_name``, for unknown hook names.
    """
    lengths = tuple(lengths)
    batch = len(lengths)
    can_fire, known = _fireable_parts(fireable)
    if intervene is None:
        return InterventionPlan(tuple({} for _ in range(batch)), {}, lengths)
    if isinstance(intervene, Mapping):
        shared, callables = _read_mapping(
            intervene, None, resolve_name, can_fire, known, allow_callables
        )
        per_prompt = tuple(
            _resolve_for_prompt(shared, index, length, feature_shape)
            for index, length in enumerate(lengths)
        )
        return InterventionPlan(per_prompt, callables, lengths)
    if not isinstance(intervene, Sequence) or isinstance(intervene, str | bytes):
        raise _error(
            "intervene: expected None, a mapping of hook name to specs, or a list with one "
            f"such mapping per prompt; found {_describe(intervene)}"
        )
    if len(intervene) != batch:
        raise _error(
            f"intervene: got a list of {len(intervene)} per-prompt mappings but the batch "
            f"has {batch} prompt(s); pass one mapping (or None) per prompt, or a single "
            "mapping for all prompts"
        )
    plans: list[dict[str, tuple[InterventionSpec, ...]]] = []
    for index, (entry, length) in enumerate(zip(intervene, lengths, strict=True)):
        if entry is None:
            plans.append({})
            continue
        if not isinstance(entry, Mapping):
            raise _error(
                f"intervene[{index}]: expected a mapping of hook name to specs or None for "
                f"prompt {index}, found {_describe(entry)}"
            )
        specs, fns = _read_mapping(entry, index, resolve_name, can_fire, known, allow_callables)
        if fns:
            name = next(iter(fns))
            raise _error(
                f"intervention on {name!r} for prompt {index}: Python hook functions apply "
                "to the whole batch; pass them in a single mapping for all prompts, not in "
                "the per-prompt list"
            )
        plans.append(_resolve_for_prompt(specs, index, length, feature_shape))
    return InterventionPlan(tuple(plans), {}, lengths)


# --------------------------------------------------------------------------- parsing


def _error(message: str) -> SpecError:
    return SpecError(message)


def _describe(raw: object) -> str:
    text = repr(raw)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(raw).__name__} {text}"


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def _parse(raw: object, where: str) -> InterventionSpec:
    if isinstance(raw, InterventionSpec):
        return raw
    if not isinstance(raw, Mapping):
        hint = ""
        if isinstance(raw, str) and raw in SPEC_OPS:
            hint = f"; write {{'op': {raw!r}}}"
        raise _error(
            f"{where}: expected a spec (a mapping with an 'op' key, or an InterventionSpec), "
            f"found {_describe(raw)}{hint}"
        )
    return _normalise(raw, where)


def _normalise(raw: Mapping[Any, Any], where: str) -> InterventionSpec:
    for key in raw:
        if key not in SPEC_KEYS:
            suggestion = _suggest(key, SPEC_KEYS) if isinstance(key, str) else ""
            raise _error(
                f"{where}: key {key!r} is not a spec key; {suggestion}"
                f"Spec keys: {', '.join(SPEC_KEYS)}"
            )
    if "op" not in raw:
        raise _error(
            f"{where}: the spec has no key 'op'; expected one of {', '.join(SPEC_OPS)}, "
            f"found keys {sorted(raw)}"
        )
    op = raw["op"]
    if not isinstance(op, str) or op not in SPEC_OPS:
        suggestion = _suggest(op, SPEC_OPS) if isinstance(op, str) else ""
        raise _error(
            f"{where}: key 'op' is {op!r}, not a spec op; {suggestion}"
            f"Spec ops: {', '.join(SPEC_OPS)}"
        )
    allowed = _OP_KEYS[op]
    for key in raw:
        if key not in allowed:
            raise _error(
                f"{where}: key {key!r} does not apply to op {op!r}; op {op!r} takes keys "
                f"{', '.join(allowed)}"
            )
    factor = value = pos = None
    if op == "scale":
        if "factor" not in raw:
            raise _error(
                f"{where}: op 'scale' needs key 'factor' (a real number), found none; "
                "e.g. {'op': 'scale', 'factor': 0.5}"
            )
        factor = _real(raw["factor"], where, "factor")
    if op in ("add", "set"):
        if "value" not in raw:
            raise _error(
                f"{where}: op {op!r} needs key 'value' (a number, a list of numbers, or one "
                f"list per listed position), found none; e.g. {{'op': {op!r}, 'value': 0.0}}"
            )
        value = _value(raw["value"], where)
    if "pos" in raw:
        pos = _positions(raw["pos"], where)
    if isinstance(value, tuple) and isinstance(value[0], tuple):
        if pos is None:
            raise _error(
                f"{where}: key 'value' is a list of {len(value)} vectors (one per position) "
                "but the spec has no key 'pos'; add 'pos' listing those positions, or pass "
                "one flat vector to edit every position"
            )
        if len(value) != len(pos):
            raise _error(
                f"{where}: key 'value' has {len(value)} per-position vectors but key 'pos' "
                f"lists {len(pos)} position(s) {list(pos)}; expected one vector per listed "
                "position"
            )
    spec = object.__new__(InterventionSpec)
    for name, item in (("op", op), ("factor", factor), ("value", value), ("pos", pos)):
        object.__setattr__(spec, name, item)
    return spec


def _plain(raw: object) -> object:
    """Tensors and arrays become (nested) lists; everything else is returned as is."""
    if hasattr(raw, "tolist") and hasattr(raw, "ndim"):
        if hasattr(raw, "detach"):
            raw = raw.detach()
        return raw.tolist()
    return raw


def _real(raw: object, where: str, key: str) -> float:
    raw = _plain(raw)
    if isinstance(raw, bool) or not isinstance(raw, numbers.Real):
        raise _error(f"{where}: key {key!r} expects a real number, found {_describe(raw)}")
    number = float(raw)
    if math.isnan(number):
        raise _error(f"{where}: key {key!r} expects a real number, found NaN")
    return number


def _value(raw: object, where: str) -> SpecValue:
    raw = _plain(raw)
    expected = "a number, a list of numbers, or a list of lists of numbers"
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        if isinstance(raw, bool) or not isinstance(raw, numbers.Real):
            raise _error(f"{where}: key 'value' expects {expected}, found {_describe(raw)}")
        return _real(raw, where, "value")
    if len(raw) == 0:
        raise _error(f"{where}: key 'value' expects {expected}, found an empty list")
    if all(isinstance(_plain(row), Sequence) for row in raw):
        rows = tuple(_vector(_plain(row), where, f"value[{i}]") for i, row in enumerate(raw))
        for i, row in enumerate(rows):
            if len(row) != len(rows[0]):
                raise _error(
                    f"{where}: key 'value' holds per-position vectors of different widths: "
                    f"{len(rows[0])} (entry 0) and {len(row)} (entry {i}); expected one "
                    "width for all"
                )
        return rows
    return _vector(raw, where, "value")


def _vector(raw: object, where: str, key: str) -> tuple[float, ...]:
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes) or len(raw) == 0:
        raise _error(
            f"{where}: key {key!r} expects a non-empty list of numbers, found {_describe(raw)}"
        )
    out = []
    for item in raw:
        if isinstance(item, bool) or not isinstance(item, numbers.Real):
            raise _error(
                f"{where}: key {key!r} expects a list of numbers (or of lists of numbers), "
                f"found element {_describe(item)}"
            )
        number = float(item)
        if math.isnan(number):
            raise _error(f"{where}: key {key!r} expects numbers, found NaN")
        out.append(number)
    return tuple(out)


def _position(raw: object, where: str) -> int:
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, bool) or not isinstance(raw, numbers.Integral):
        raise _error(
            f"{where}: key 'pos' expects an int or a non-empty list of distinct ints, found "
            f"{_describe(raw)}"
        )
    return int(raw)


def _positions(raw: object, where: str) -> tuple[int, ...]:
    raw = _plain(raw)
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        return (_position(raw, where),)
    if len(raw) == 0:
        raise _error(
            f"{where}: key 'pos' expects an int or a non-empty list of distinct ints, found "
            "an empty list; omit 'pos' to edit every position"
        )
    out = tuple(_position(item, where) for item in raw)
    if len(set(out)) != len(out):
        repeated = next(p for p in out if out.count(p) > 1)
        raise _error(
            f"{where}: key 'pos' lists position {repeated} more than once; expected distinct "
            "positions"
        )
    return out


def _to_lists(value: SpecValue) -> float | list[float] | list[list[float]]:
    if not isinstance(value, tuple):
        return value
    rows: list[list[float]] = []
    flat: list[float] = []
    for item in value:
        if isinstance(item, tuple):
            rows.append(list(item))
        else:
            flat.append(item)
    return rows or flat


# --------------------------------------------------------------------------- planning


_ShapeFn = Callable[[str], "tuple[int, ...] | None"]


def _fireable_parts(
    fireable: Callable[[str], bool] | Collection[str],
) -> tuple[Callable[[str], bool], Collection[str] | None]:
    # Collections first: a ModuleDict of hook points is both a collection and callable.
    if isinstance(fireable, Collection) and not isinstance(fireable, str):
        names = fireable
        return (lambda name: name in names), names
    predicate = cast("Callable[[str], bool]", fireable)
    owner = getattr(predicate, "__self__", None)
    if isinstance(owner, Collection) and not isinstance(owner, str):
        return predicate, owner
    return predicate, None


def _read_mapping(
    mapping: Mapping[Any, Any],
    prompt: int | None,
    resolve_name: Callable[[str], str],
    can_fire: Callable[[str], bool],
    known: Collection[str] | None,
    allow_callables: bool,
) -> tuple[
    dict[str, list[tuple[str, InterventionSpec]]], dict[str, tuple[Callable[..., Any], ...]]
]:
    """Canonical hook -> [(name as typed, spec)], and canonical hook -> callables."""
    specs: dict[str, list[tuple[str, InterventionSpec]]] = {}
    fns: dict[str, list[Callable[..., Any]]] = {}
    for name, entry in mapping.items():
        if not isinstance(name, str):
            raise _error(f"intervene: hook names must be strings, found {_describe(name)}")
        where = f"intervention on {name!r}" + ("" if prompt is None else f" for prompt {prompt}")
        items = list(entry) if _is_list(entry) else [entry]
        if not items:
            continue
        canonical = resolve_name(name)
        if not can_fire(canonical):
            raise _error(_unfireable_message(where, name, canonical, known))
        callables = [item for item in items if _is_callable(item)]
        if callables and not allow_callables:
            raise _error(
                f"{where}: this driver takes declarative specs only, found Python function "
                f"{_callable_name(callables[0])!r}; use a spec instead: {{'op': 'suppress'}}, "
                "{'op': 'scale', 'factor': f}, {'op': 'add', 'value': v} or "
                f"{{'op': 'set', 'value': v}} (spec ops: {', '.join(SPEC_OPS)})"
            )
        if callables and len(callables) != len(items):
            raise _error(
                f"{where}: a hook's list holds either specs or Python hook functions, not "
                "both (specs run before hook functions); give them in separate entries"
            )
        if callables:
            fns.setdefault(canonical, []).extend(callables)
        else:
            specs.setdefault(canonical, []).extend((name, _parse(i, where)) for i in items)
    return specs, {name: tuple(f) for name, f in fns.items()}


def _callable_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _is_list(entry: object) -> bool:
    return isinstance(entry, Sequence) and not isinstance(entry, str | bytes | Mapping)


def _is_callable(entry: object) -> bool:
    return callable(entry) and not isinstance(entry, InterventionSpec | Mapping | type)


def _unfireable_message(
    where: str, name: str, canonical: str, known: Collection[str] | None
) -> str:
    alias = "" if canonical == name else f" (canonical {canonical!r})"
    message = f"{where}{alias}: the driver cannot intervene on this hook"
    if known is None:
        return message + "; see the driver's supported_hook_points for the hooks it can edit"
    choices = sorted(known)
    suggestion = _suggest(canonical, choices)
    shown = ", ".join(choices[:12]) + (f" (+{len(choices) - 12} more)" if len(choices) > 12 else "")
    return f"{message}; {suggestion}Hooks it can intervene on: {shown or 'none'}"


def _resolve_for_prompt(
    specs: Mapping[str, list[tuple[str, InterventionSpec]]],
    index: int,
    length: int,
    feature_shape: _ShapeFn,
) -> dict[str, tuple[InterventionSpec, ...]]:
    out: dict[str, tuple[InterventionSpec, ...]] = {}
    for canonical, entries in specs.items():
        shape = feature_shape(canonical)
        width = length if shape is None else math.prod(shape)
        resolved = []
        for name, spec in entries:
            where = f"intervention on {name!r}"
            _check_width(spec, width, shape, index, length, where)
            resolved.append(_resolve_positions(spec, index, length, where))
        out[canonical] = tuple(resolved)
    return out


def _check_width(
    spec: InterventionSpec,
    width: int,
    shape: tuple[int, ...] | None,
    index: int,
    length: int,
    where: str,
) -> None:
    value = spec.value
    if not isinstance(value, tuple):
        return
    found = len(value[0]) if isinstance(value[0], tuple) else len(value)
    if found == width:
        return
    if shape is None:
        where = f"{where} for prompt {index}"
        what = f"the prompt's length {length} (this hook's features are key positions)"
    else:
        what = f"{width} (the hook's feature shape is {shape})"
    raise _error(
        f"{where}: key 'value' has width {found}, expected {what}; pass a scalar, a "
        f"{width}-long vector, or one {width}-long vector per listed position"
    )


def _resolve_positions(
    spec: InterventionSpec, index: int, length: int, where: str
) -> InterventionSpec:
    if spec.pos is None:
        return spec
    absolute = []
    for p in spec.pos:
        if not -length <= p < length:
            raise _error(
                f"{where} for prompt {index}: key 'pos' lists position {p}, out of range for "
                f"a prompt of length {length} (valid positions: {-length}..{length - 1})"
            )
        absolute.append(p + length if p < 0 else p)
    if len(set(absolute)) != len(absolute):
        raise _error(
            f"{where} for prompt {index}: key 'pos' {list(spec.pos)} names one position twice "
            f"in a prompt of length {length} (as {absolute}); expected distinct positions"
        )
    resolved = tuple(absolute)
    return spec if resolved == spec.pos else replace(spec, pos=resolved)
