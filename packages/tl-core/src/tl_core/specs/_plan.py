"""``build_plan``: validate a whole ``intervene=`` argument against a driver and a batch.

The result, an ``InterventionPlan``, holds per-prompt specs with positions resolved, ready
for a driver to compile (``tl_core.specs._affine``) and apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tl_core.hooks._vocabulary import on_decoder_positions
from tl_core.specs._specs import (
    IMAGE_POSITIONS,
    SPEC_OPS,
    InterventionSpec,
    _describe,
    _error,
    _parse,
    absolute_positions,
    listed_positions,
)

if TYPE_CHECKING:
    from tl_core.hooks._namespace import HookNamespace

__all__ = ["InterventionPlan", "build_plan"]


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
    namespace: HookNamespace,
    allow_callables: bool,
    image_positions: Sequence[tuple[int, ...]] | None = None,
    decoder_lengths: Sequence[int] | None = None,
) -> InterventionPlan:
    """Validate a whole ``intervene=`` argument against a driver and a batch.

    Args:
        intervene: ``None``; a mapping ``hook -> spec | [spec, ...] | callable`` applied to
            every prompt; or a sequence with one such mapping (or ``None``) per prompt.
            Two spellings of one hook (alias and canonical) merge in the order given.
        lengths: The real (unpadded) length of each prompt; the batch size is its length.
        namespace: The model's hook namespace: it resolves names (aliases per model),
            says which hooks specs may edit (callables need only a served hook), and
            gives each hook's feature shape (``None`` for attention scores and patterns,
            whose width is the prompt's length).
        allow_callables: Whether the driver accepts Python hook functions.
        image_positions: Each prompt's image positions, where the run has images: what
            ``"pos": "image"`` edits (``None``: such a spec is refused).
        decoder_lengths: An encoder-decoder's decoder inputs' lengths, per prompt: the
            positions of specs on sites over the decoder's positions
            (``on_decoder_positions``) are checked against these.

    Returns:
        The plan, with canonical names and absolute positions.

    Raises:
        SpecError: On any malformed spec, a spec on a hook the driver cannot edit, a wrong
            width or position, a callable the driver cannot run, or a per-prompt list whose
            length is not the batch size.
        HookNameError: Unknown hook names, or hooks the driver does not serve.
    """
    lengths = tuple(lengths)
    batch = len(lengths)
    if intervene is None:
        return InterventionPlan(tuple({} for _ in range(batch)), {}, lengths)
    if isinstance(intervene, Mapping):
        shared, callables = _read_mapping(intervene, None, namespace, allow_callables)
        per_prompt = tuple(
            _resolve_for_prompt(
                shared, index, length, namespace, image_positions, _nth(decoder_lengths, index)
            )
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
        specs, fns = _read_mapping(entry, index, namespace, allow_callables)
        if fns:
            name = next(iter(fns))
            raise _error(
                f"intervention on {name!r} for prompt {index}: Python hook functions apply "
                "to the whole batch; pass them in a single mapping for all prompts, not in "
                "the per-prompt list"
            )
        plans.append(
            _resolve_for_prompt(
                specs, index, length, namespace, image_positions, _nth(decoder_lengths, index)
            )
        )
    return InterventionPlan(tuple(plans), {}, lengths)


# --------------------------------------------------------------------------- parsing


def _read_mapping(
    mapping: Mapping[Any, Any],
    prompt: int | None,
    namespace: HookNamespace,
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
        callables = [item for item in items if _is_callable(item)]
        # Resolved once: specs need an editable hook, functions only a served one.
        canonical = namespace.lookup(name, edit=not callables)
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
            parsed = [_parse(i, where) for i in items]
            if canonical.endswith(".hook_scale"):
                for spec in parsed:
                    _check_divisor(spec, where)
            specs.setdefault(canonical, []).extend((name, spec) for spec in parsed)
    return specs, {name: tuple(f) for name, f in fns.items()}


_SMALLEST_DIVISOR = 1e-6


def _check_divisor(spec: InterventionSpec, where: str) -> None:
    """A norm's ``hook_scale`` divides its input: an edit that makes it 0 turns the output
    into infinities (and the logits into NaN), so ``suppress``, ``scale`` by less than 1e-6
    in magnitude and ``set`` to a value below 1e-6 are refused there."""
    values: list[float] = []
    if isinstance(spec.value, tuple):
        values = [v for row in spec.value for v in (row if isinstance(row, tuple) else (row,))]
    elif spec.value is not None:
        values = [spec.value]
    zero = (
        spec.op == "suppress"
        # Dividing by a scale shrunk a millionfold blows the block's activations past what
        # float32 carries through an MLP (infinities, then NaN logits).
        or (spec.op == "scale" and spec.factor is not None and abs(spec.factor) < _SMALLEST_DIVISOR)
        or (spec.op == "set" and any(v < _SMALLEST_DIVISOR for v in values))
    )
    if zero:
        raise _error(
            f"{where}: a norm's hook_scale is the divisor sqrt(var + eps), so {spec.to_dict()} "
            "would divide by (nearly) zero or flip the sign and make the outputs infinite or "
            "NaN; scale it by a factor of magnitude >= 1e-6, set it to a value >= 1e-6, or "
            "edit hook_normalized instead"
        )


def _callable_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _is_list(entry: object) -> bool:
    return isinstance(entry, Sequence) and not isinstance(entry, str | bytes | Mapping)


def _is_callable(entry: object) -> bool:
    return callable(entry) and not isinstance(entry, InterventionSpec | Mapping | type)


def _nth(lengths: Sequence[int] | None, index: int) -> int | None:
    return None if lengths is None else lengths[index]


def _resolve_for_prompt(
    specs: Mapping[str, list[tuple[str, InterventionSpec]]],
    index: int,
    prompt_length: int,
    namespace: HookNamespace,
    images: Sequence[tuple[int, ...]] | None = None,
    decoder_length: int | None = None,
) -> dict[str, tuple[InterventionSpec, ...]]:
    out: dict[str, tuple[InterventionSpec, ...]] = {}
    for canonical, entries in specs.items():
        on_decoder = decoder_length is not None and on_decoder_positions(canonical)
        length = decoder_length if on_decoder and decoder_length is not None else prompt_length
        shape = namespace.feature_shape(canonical)
        width = length if shape is None else math.prod(shape)
        resolved = []
        for name, spec in entries:
            where = f"intervention on {name!r}"
            if spec.features is not None:
                _check_features(spec, width, shape, where)
            _check_width(
                spec,
                width if spec.features is None else len(spec.features),
                shape,
                index,
                length,
                where,
            )
            placed = _resolve_positions(spec, index, length, where, None if on_decoder else images)
            if placed is not None:
                resolved.append(placed)
        if resolved:
            out[canonical] = tuple(resolved)
    return out


def _check_features(
    spec: InterventionSpec, width: int, shape: tuple[int, ...] | None, where: str
) -> None:
    if shape is None:
        raise _error(
            f"{where}: key 'features' does not apply to attention scores or patterns (their "
            "feature axis is the key position); use 'pos' and a per-key vector instead"
        )
    wrong = [f for f in spec.features or () if f >= width]
    if wrong:
        raise _error(
            f"{where}: key 'features' lists feature {wrong[0]}, out of range for this hook's "
            f"{width} features (feature shape {shape}; valid indices 0..{width - 1})"
        )


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
    elif spec.features is not None:
        what = f"{width} (one number per feature listed in 'features')"
    else:
        what = f"{width} (the hook's feature shape is {shape})"
    raise _error(
        f"{where}: key 'value' has width {found}, expected {what}; pass a scalar, a "
        f"{width}-long vector, or one {width}-long vector per listed position"
    )


def _resolve_positions(
    spec: InterventionSpec,
    index: int,
    length: int,
    where: str,
    images: Sequence[tuple[int, ...]] | None,
) -> InterventionSpec | None:
    """``spec`` with absolute positions for prompt ``index`` (``None``: a spec on the image
    positions of a prompt that holds none, which edits nothing there)."""
    if spec.pos is None:
        return spec
    if spec.pos == IMAGE_POSITIONS:
        if images is None:
            raise _error(
                f"{where}: 'pos': 'image' edits the prompts' image positions, and this run "
                "has no images; pass images= (a vision-language model), or list positions"
            )
        return replace(spec, pos=images[index]) if images[index] else None
    resolved = absolute_positions(
        listed_positions(spec.pos),
        length,
        where=f"{where} for prompt {index}",
        span=f"a prompt of length {length}",
    )
    return spec if resolved == spec.pos else replace(spec, pos=resolved)
