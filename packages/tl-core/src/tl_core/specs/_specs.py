"""Intervention specs: the one schema, validator and parser every driver uses.

A spec is plain data (``{"op": "scale", "factor": 0.5, "pos": [3]}``) that compiles to an
affine edit ``x * scale + bias`` (see ``tl_core.specs._affine``). ``parse_spec`` checks one spec's
structure; ``build_plan`` checks a whole ``intervene=`` argument against a driver and a
batch (hook names, fireability, widths, positions) before any model work starts.
"""

from __future__ import annotations

import difflib
import math
import numbers
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

from tl_core._errors import SpecError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "SPEC_JSON_SCHEMA",
    "SPEC_KEYS",
    "SPEC_OPS",
    "InterventionSpec",
    "SpecLike",
    "SpecValue",
    "SpecValueLike",
    "IMAGE_POSITIONS",
    "absolute_positions",
    "listed_positions",
    "parse_spec",
]

SpecOp: TypeAlias = Literal["suppress", "scale", "add", "set"]
_Pos: TypeAlias = 'int | Sequence[int] | Literal["image"] | None'
SPEC_OPS: tuple[SpecOp, ...] = ("suppress", "scale", "add", "set")
"""The spec operations, in documentation order."""

SPEC_KEYS: tuple[str, ...] = ("op", "factor", "value", "pos", "features")
"""Every key a spec mapping may hold."""

_OP_KEYS: dict[str, tuple[str, ...]] = {
    "suppress": ("op", "pos", "features"),
    "scale": ("op", "factor", "pos", "features"),
    "add": ("op", "value", "pos", "features"),
    "set": ("op", "value", "pos", "features"),
}

# The largest finite float32. The parser does not know the model's dtype, and tl's engines
# compute in float32 or narrower, where a larger number becomes an infinity (and every
# logit NaN), so spec numbers of greater magnitude are refused.
_FLOAT32_MAX = 3.4028234663852886e38

_OVERFLOWS = (
    "which overflows float32 (the model's dtype: tl's engines compute in float32 or "
    f"narrower); expected a magnitude of at most {_FLOAT32_MAX:.8g}"
)

SpecValue: TypeAlias = "float | tuple[float, ...] | tuple[tuple[float, ...], ...]"
"""A normalised ``value``: a scalar, one flat vector, or one flat vector per position."""

SpecValueLike: TypeAlias = (
    "float | Sequence[float] | Sequence[Sequence[float]] | torch.Tensor | np.ndarray[Any, Any]"
)
"""What ``value`` may be given as; tensors and arrays are converted to tuples."""

_NUMBER = {"type": "number", "minimum": -_FLOAT32_MAX, "maximum": _FLOAT32_MAX}
_VECTOR = {"type": "array", "items": _NUMBER, "minItems": 1}
_POS = {
    "oneOf": [
        {"type": "integer"},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "uniqueItems": True},
        {"const": "image"},
    ],
    "description": "Sequence positions to edit (negative counts from the prompt's end), or "
    "'image': the positions of the prompt's image tokens (a vision-language model run with "
    "images); absent means every position.",
}

#: The named position selector of ``pos``: the prompt's image positions.
IMAGE_POSITIONS: Literal["image"] = "image"
_FEATURES = {
    "oneOf": [
        {"type": "integer", "minimum": 0},
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0},
            "minItems": 1,
            "uniqueItems": True,
        },
    ],
    "description": "Indices into the hook's (flattened) feature axis to edit, e.g. an SAE's "
    "features on hook_sae_acts_post or neurons on mlp.hook_post; absent means all of them. "
    "Vector values then hold one number per listed feature.",
}
_VALUE = {
    "oneOf": [
        _NUMBER,
        _VECTOR,
        {"type": "array", "items": _VECTOR, "minItems": 1},
    ],
    "description": "A scalar, a flat vector of the hook's feature width, or one such "
    "vector per listed position (then 'pos' is required). Every number is finite and fits "
    "float32.",
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
        "properties": {
            "op": {"const": op},
            **extra,
            "pos": {"$ref": "#/$defs/pos"},
            "features": {"$ref": "#/$defs/features"},
        },
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
    "$defs": {"pos": _POS, "value": _VALUE, "features": _FEATURES},
}
"""The published JSON Schema (draft 2020-12) of one spec object."""


@dataclass(frozen=True)
class InterventionSpec:
    """One declarative edit of a hook's activation.

    Construct with the class methods (``InterventionSpec.scale(0.5, pos=[3])``), from a
    mapping with ``parse_spec``, or directly; every route validates and normalises the
    fields (numbers become floats, vectors tuples, a single position a 1-tuple). Every
    number must be finite and of magnitude at most float32's largest (3.4028235e38).

    Attributes:
        op: ``"suppress"`` (x -> 0), ``"scale"`` (x -> factor * x), ``"add"``
            (x -> x + value) or ``"set"`` (x -> value).
        factor: The multiplier; ``scale`` only.
        value: ``add``/``set`` only: a scalar, a flat vector of the hook's feature width,
            or one such vector per position listed in ``pos``.
        pos: Sequence positions to edit (negative ones count from the prompt's end),
            ``"image"`` for the positions of the prompt's image tokens (a vision-language
            model run with ``images=``), or ``None`` for every position.
        features: Indices into the hook's flattened feature axis to edit (an SAE's features
            on ``hook_sae_acts_post``, neurons on ``mlp.hook_post``); ``None`` edits all.
            Vector values then hold one number per listed feature.
    """

    op: SpecOp
    factor: float | None = None
    value: SpecValue | None = None
    pos: tuple[int, ...] | Literal["image"] | None = None
    features: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        fields = {
            "op": self.op,
            "factor": self.factor,
            "value": self.value,
            "pos": self.pos,
            "features": self.features,
        }
        normalised = _normalise(
            {k: v for k, v in fields.items() if v is not None}, "InterventionSpec"
        )
        for name in ("factor", "value", "pos", "features"):
            object.__setattr__(self, name, getattr(normalised, name))

    @classmethod
    def suppress(cls, pos: _Pos = None) -> InterventionSpec:
        """``x -> 0`` at ``pos`` (every position when ``None``)."""
        return cls("suppress", pos=cast(Any, pos))

    @classmethod
    def scale(cls, factor: float, pos: _Pos = None) -> InterventionSpec:
        """``x -> factor * x`` at ``pos`` (every position when ``None``)."""
        return cls("scale", factor=factor, pos=cast(Any, pos))

    @classmethod
    def add(cls, value: SpecValueLike, pos: _Pos = None) -> InterventionSpec:
        """``x -> x + value`` at ``pos`` (every position when ``None``)."""
        return cls("add", value=cast(Any, value), pos=cast(Any, pos))

    @classmethod
    def set(cls, value: SpecValueLike, pos: _Pos = None) -> InterventionSpec:
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
            out["pos"] = self.pos if self.pos == IMAGE_POSITIONS else list(self.pos)
        if self.features is not None:
            out["features"] = list(self.features)
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
            op, or a key whose value has the wrong type or form, or holds a NaN, an
            infinity or a number that overflows float32.
    """
    return _parse(raw, f"intervention on {hook!r}")


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
    factor = value = pos = features = None
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
    if "features" in raw:
        features = _features(raw["features"], where)
    if isinstance(value, tuple) and isinstance(value[0], tuple):
        if pos == IMAGE_POSITIONS:
            raise _error(
                f"{where}: key 'value' is a list of {len(value)} vectors (one per position), "
                "but 'pos': 'image' lists no positions until the prompt is known; pass one "
                "flat vector (or a scalar) for every image position, or list the positions"
            )
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
    for name, item in (
        ("op", op),
        ("factor", factor),
        ("value", value),
        ("pos", pos),
        ("features", features),
    ):
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
    number = _float(raw)
    if math.isnan(number):
        raise _error(f"{where}: key {key!r} expects a real number, found NaN")
    if math.isinf(number):
        raise _error(
            f"{where}: key {key!r} expects a finite number, found {number}; an infinite "
            "edit turns the model's outputs into NaN"
        )
    if abs(number) > _FLOAT32_MAX:
        raise _error(f"{where}: key {key!r} is {_short(raw)}, {_OVERFLOWS}")
    return number


def _float(raw: numbers.Real) -> float:
    """``float(raw)``, or float64's largest magnitude for a number beyond float64 (a huge
    int), which the float32 range check then refuses."""
    try:
        return float(raw)
    except OverflowError:
        return -sys.float_info.max if raw < 0 else sys.float_info.max


def _short(raw: object) -> str:
    text = repr(raw)
    return text if len(text) <= 30 else f"{text[:12]}...({len(text)} characters)"


def _check_element(raw: numbers.Real, where: str, key: str, index: str) -> float:
    number = _float(raw)
    if math.isnan(number) or math.isinf(number):
        found = "NaN" if math.isnan(number) else str(number)
        raise _error(
            f"{where}: key {key!r} expects finite numbers, found {found} at index {index}; "
            "a non-finite edit turns the model's outputs into NaN"
        )
    if abs(number) > _FLOAT32_MAX:
        raise _error(f"{where}: key {key!r} has {_short(raw)} at index {index}, {_OVERFLOWS}")
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
        rows = tuple(_vector(_plain(row), where, "value", i) for i, row in enumerate(raw))
        for i, row in enumerate(rows):
            if len(row) != len(rows[0]):
                raise _error(
                    f"{where}: key 'value' holds per-position vectors of different widths: "
                    f"{len(rows[0])} (entry 0) and {len(row)} (entry {i}); expected one "
                    "width for all"
                )
        return rows
    return _vector(raw, where, "value")


def _vector(raw: object, where: str, key: str, row: int | None = None) -> tuple[float, ...]:
    prefix = "" if row is None else f"[{row}]"
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes) or len(raw) == 0:
        raise _error(
            f"{where}: key {key + prefix!r} expects a non-empty list of numbers, found "
            f"{_describe(raw)}"
        )
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, bool) or not isinstance(item, numbers.Real):
            raise _error(
                f"{where}: key {key + prefix!r} expects a list of numbers (or of lists of "
                f"numbers), found element {_describe(item)}"
            )
        out.append(_check_element(item, where, key, f"{prefix}[{i}]"))
    return tuple(out)


def _distinct_ints(
    raw: object,
    where: str,
    key: str,
    *,
    expected: str,
    omit: str,
    noun: str,
    distinct: str,
    minimum: int | None = None,
) -> tuple[int, ...]:
    """An int or a non-empty list of distinct ints (``pos``, ``features``), as a tuple.

    ``expected`` says what the key takes, ``omit`` what leaving it out does, ``noun`` and
    ``distinct`` name a repeated value; ``minimum`` bounds every value from below.
    """
    raw = _plain(raw)
    items = raw if isinstance(raw, Sequence) and not isinstance(raw, str | bytes) else [raw]
    if len(items) == 0:
        raise _error(f"{where}: key {key!r} expects {expected}, found an empty list; {omit}")
    out = []
    for item in items:
        if isinstance(item, float) and item.is_integer():
            item = int(item)
        if (
            isinstance(item, bool)
            or not isinstance(item, numbers.Integral)
            or (minimum is not None and item < minimum)
        ):
            raise _error(f"{where}: key {key!r} expects {expected}, found {_describe(item)}")
        out.append(int(item))
    if len(set(out)) != len(out):
        repeated = next(v for v in out if out.count(v) > 1)
        raise _error(
            f"{where}: key {key!r} lists {noun} {repeated} more than once; expected {distinct}"
        )
    return tuple(out)


def _positions(raw: object, where: str) -> tuple[int, ...] | Literal["image"]:
    if isinstance(raw, str):
        if raw == IMAGE_POSITIONS:
            return IMAGE_POSITIONS
        raise _error(
            f"{where}: key 'pos' is {raw!r}; the one named position is 'image' (the prompt's "
            "image tokens), else give an int or a non-empty list of distinct ints"
        )
    return _distinct_ints(
        raw, where, "pos", expected="an int or a non-empty list of distinct ints",
        omit="omit 'pos' to edit every position", noun="position", distinct="distinct positions",
    )  # fmt: skip


def listed_positions(pos: tuple[int, ...] | Literal["image"]) -> tuple[int, ...]:
    """A placed spec's positions (``build_plan`` replaces ``"image"`` by the prompt's)."""
    if pos == IMAGE_POSITIONS:
        raise SpecError(
            "'pos': 'image' reached an engine unresolved: build the plan with the prompts' "
            "image positions (build_plan(..., image_positions=...))"
        )
    return pos


def absolute_positions(
    positions: Sequence[int], length: int, *, where: str = "", span: str = ""
) -> tuple[int, ...]:
    """``pos`` resolved against a sequence: negative positions count from its end.

    Args:
        positions: The spec's positions (already parsed: ints).
        length: The sequence's length.
        where: What the message names first (``"intervention on 'blocks.0.hook_out' for
            prompt 1"``), or ``""``.
        span: How the message names the sequence; default ``"{length} position(s)"``.

    Raises:
        SpecError: A position outside ``-length..length-1``, or two that name the same
            position once resolved (``[-1, 3]`` in a sequence of 4).
    """
    prefix = f"{where}: " if where else ""
    span = span or f"{length} position(s)"
    absolute = []
    for p in positions:
        if not -length <= p < length:
            raise _error(
                f"{prefix}key 'pos' lists position {p}, out of range for {span} "
                f"(valid positions: {-length}..{length - 1})"
            )
        absolute.append(p + length if p < 0 else p)
    if len(set(absolute)) != len(absolute):
        raise _error(
            f"{prefix}key 'pos' {list(positions)} names one position twice in {span} (as {absolute}); "
            "expected distinct positions"
        )
    return tuple(absolute)


def _features(raw: object, where: str) -> tuple[int, ...]:
    return _distinct_ints(
        raw, where, "features", expected="a feature index (an int >= 0) or a non-empty list of distinct ones",
        omit="omit it to edit every feature", noun="feature", distinct="distinct indices", minimum=0,
    )  # fmt: skip


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
