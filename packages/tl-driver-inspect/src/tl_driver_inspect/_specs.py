"""Checking and normalising the ``intervene`` argument of the solvers.

Structure and names are checked without a model (at solver construction); widths,
served hooks and editability against the model's namespace at the first sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tl_core import SpecError, canonical_name, parse_spec
from tl_core.driver_api import absolute_positions

if TYPE_CHECKING:
    from tl_core.hooks import HookNamespace

__all__ = ["absolute_specs", "check_hooks", "check_specs", "normalise_specs"]


def normalise_specs(specs: object) -> dict[str, list[dict[str, Any]]]:
    """Validate the schema of ``specs`` and return them as plain JSON-able data.

    Args:
        specs: A mapping hook name -> one spec or a list of specs (dicts or
            ``InterventionSpec``).

    Returns:
        Hook name (as given) -> list of normalised spec dicts.

    Raises:
        SpecError: Not a mapping, an empty list, or a malformed spec (tl-core's message).
        HookNameError: A name no model has (with the nearest names).
    """
    if not isinstance(specs, Mapping):
        raise SpecError(
            f"intervene(specs): expected a mapping of hook name to a spec or a list of specs, "
            f"found {type(specs).__name__}: {specs!r}"
        )
    out: dict[str, list[dict[str, Any]]] = {}
    for hook, entry in specs.items():
        if not isinstance(hook, str):
            raise SpecError(f"intervene(specs): hook names must be strings, found {hook!r}")
        canonical_name(hook)
        items = (
            list(entry)
            if isinstance(entry, Sequence) and not isinstance(entry, str | bytes)
            else [entry]
        )
        if not items:
            raise SpecError(
                f"intervention on {hook!r}: an empty list of specs does nothing; remove the entry"
            )
        out.setdefault(hook, []).extend(parse_spec(item, hook=hook).to_dict() for item in items)
    return out


def check_hooks(names: Sequence[str], namespace: HookNamespace) -> list[str]:
    """Canonical names of ``names`` on this model; each must be served (aliases resolve)."""
    return list(dict.fromkeys(namespace.lookup(name) for name in names))


def check_specs(specs: Mapping[str, Sequence[Mapping[str, Any]]], namespace: HookNamespace) -> None:
    """Check specs against the model: served, editable, vector widths.

    Positions depend on each prompt and are checked by the driver before generating.

    Raises:
        HookNameError, SpecError: With tl-core's message naming the hook.
    """
    for hook, items in specs.items():
        canonical = namespace.lookup(hook, edit=True)
        shape = namespace.feature_shape(canonical)
        width = shape[-1] if shape else None
        for item in items:
            value = item.get("value")
            if width is None or not isinstance(value, list) or not value:
                continue
            rows = value if isinstance(value[0], list) else [value]
            for row in rows:
                if len(row) != width:
                    raise SpecError(
                        f"intervention on {hook!r} ({canonical!r}): 'value' has width "
                        f"{len(row)}, expected {width} (the hook's last dimension)"
                    )


def absolute_specs(
    specs: Mapping[str, Sequence[Mapping[str, Any]]] | None, prompt_len: int
) -> dict[str, list[dict[str, Any]]] | None:
    """``specs`` with negative ``pos`` made absolute against the prompt's length.

    Generation resolves ``pos=-1`` against the prompt; a later forward over prompt plus
    generated tokens must edit the same positions.

    Raises:
        SpecError: A position outside the prompt (``pos=-9`` on a 5-token prompt would
            otherwise count from the end of prompt plus completion instead), or two that
            name one position.
    """
    if not specs:
        return None
    out: dict[str, list[dict[str, Any]]] = {}
    for hook, items in specs.items():
        fixed = []
        for item in items:
            spec = dict(item)
            if "pos" in spec:
                pos = spec["pos"]
                many = isinstance(pos, list | tuple)
                values = absolute_positions(
                    [int(p) for p in (pos if many else [pos])], prompt_len,
                    where=f"intervention on {hook!r}", span=f"a prompt of {prompt_len} tokens",
                )  # fmt: skip
                spec["pos"] = list(values) if many else values[0]
            fixed.append(spec)
        out[hook] = fixed
    return out
