"""Property tests over the input surface of a bridge: specs, hook names and token inputs.

Every drawn case either runs and equals a reference computed another way, or is refused
with a tl ``UserError`` before any forward pass starts (a hook on the first site records
whether one did). Never a raw exception type, never a non-finite output from finite
inputs. Native models here; the hf and vllm drivers' suites load this file and run the
same checks (``test_input_properties.py`` in each).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from tl_core import TransformerBridge, UserError

#: Hypothesis settings shared by every property: bounded for CI, no deadline (the first
#: example pays for lazy imports).
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
FINITE = st.floats(-8.0, 8.0, allow_nan=False)
BAD_NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, 1e39, -1e300])


@contextmanager
def watched(bridge: Any) -> Iterator[list[int]]:
    """A list that grows when a forward pass reaches the embedding."""
    fired: list[int] = []
    with bridge.hooks([("embed.hook_out", lambda x, hook: fired.append(1))]):
        yield fired


def outcome(bridge: Any, call: Callable[[], Any]) -> Any:
    """``call()``'s result, or the ``UserError`` it raised before any forward pass."""
    with watched(bridge) as fired:
        try:
            return call()
        except UserError as error:
            assert not fired, f"refused only after the forward started: {error}"
            return error


# -- specs ----------------------------------------------------------------------------


def _positional_sites(bridge: Any) -> list[str]:
    """Editable sites whose second axis is the position (the reference edits those)."""
    ns = bridge.namespace
    return sorted(h for h in ns.editable if ns.layout(h).startswith("b p "))


@st.composite
def spec_cases(draw: st.DrawFn, bridge: Any, lengths: tuple[int, ...]) -> tuple[str, Any]:
    """A site and a spec on it: right or wrong widths, positions in or out of range, numbers
    finite or not."""
    site = draw(st.sampled_from(_positional_sites(bridge)))
    shape = bridge.namespace.feature_shape(site) or (1,)
    width = math.prod(shape) + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
    shortest = min(lengths)
    positions = st.integers(-shortest - 2, shortest + 1)
    pos = draw(st.none() | positions | st.lists(positions, min_size=1, max_size=3))
    number = FINITE | BAD_NUMBERS if draw(st.integers(0, 5)) == 0 else FINITE
    op = draw(st.sampled_from(["suppress", "scale", "add", "set"]))
    spec: dict[str, Any] = {"op": op}
    if op == "scale":
        spec["factor"] = draw(number)
    elif op in ("add", "set"):
        kind = draw(st.sampled_from(["scalar", "vector", "per-position"]))
        if kind == "scalar":
            spec["value"] = draw(number)
        elif kind == "vector" or not isinstance(pos, list):
            spec["value"] = draw(st.lists(number, min_size=max(width, 1), max_size=max(width, 1)))
        else:
            row = st.lists(number, min_size=max(width, 1), max_size=max(width, 1))
            spec["value"] = draw(st.lists(row, min_size=len(pos), max_size=len(pos)))
    if pos is not None:
        spec["pos"] = pos
    return site, spec


def _edit_by_hand(
    spec: dict[str, Any], shape: tuple[int, ...], lengths: tuple[int, ...]
) -> Callable[..., Any]:
    """A Python hook doing what ``spec`` means, position by position, for the reference."""

    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
        out = x.clone()
        for b, n in enumerate(lengths):
            listed = spec.get("pos")
            positions = (
                list(range(n))
                if listed is None
                else [listed]
                if isinstance(listed, int)
                else listed
            )
            for k, p in enumerate(positions):
                p = p + n if p < 0 else p
                value = spec.get("value")
                if isinstance(value, list) and value and isinstance(value[0], list):
                    value = value[k]
                v = (
                    torch.tensor(value, dtype=x.dtype).reshape(shape)
                    if isinstance(value, list)
                    else value
                )
                if spec["op"] == "suppress":
                    out[b, p] = 0.0
                elif spec["op"] == "scale":
                    out[b, p] = out[b, p] * spec["factor"]
                elif spec["op"] == "add":
                    out[b, p] = out[b, p] + v
                else:
                    out[b, p] = v
        return out

    return hook


def check_spec_property(
    bridge: Any, data: st.DataObject, reference: Any = None, tolerance: float = 1e-5
) -> None:
    """A spec is refused before the forward, or equals the same edit made by hand (on
    ``reference``, a local bridge of the same checkpoint, when ``bridge`` cannot run
    editing hooks: a remote engine)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    lengths = (7, 4)
    site, spec = data.draw(spec_cases(bridge, lengths))
    got = outcome(bridge, lambda: bridge(prompts, intervene={site: spec}, prepend_bos=False))
    if isinstance(got, UserError):
        return
    local = bridge if reference is None else reference
    shape = bridge.namespace.feature_shape(site) or (1,)
    want = local.run_with_hooks(
        prompts, fwd_hooks=[(site, _edit_by_hand(spec, shape, lengths))], prepend_bos=False
    )
    for b, n in enumerate(lengths):
        torch.testing.assert_close(
            got[b, :n].float(),
            want[b, :n].float(),
            atol=tolerance,
            rtol=tolerance,
            msg=f"{site} {spec}",
        )
    assert bool(torch.isfinite(got[0, :7]).all() and torch.isfinite(got[1, :4]).all()), (
        f"{site} {spec}"
    )


# -- hook names -----------------------------------------------------------------------


@st.composite
def hook_names(draw: st.DrawFn, bridge: Any) -> str:
    """A served name, one of its aliases, or a name with a typo or none on this model."""
    ns = bridge.namespace
    base = draw(st.sampled_from(sorted(ns.served)))
    kind = draw(st.sampled_from(["canonical", "legacy", "typo", "absent layer", "junk"]))
    if kind == "legacy":
        legacy = {".hook_out": ".hook_resid_post", ".hook_in": ".hook_resid_pre"}
        for ending, alias in legacy.items():
            if base.startswith("blocks.") and base.endswith(ending) and base.count(".") == 2:
                return base[: -len(ending)] + alias
        return base
    if kind == "typo":
        i = draw(st.integers(0, len(base) - 1))
        return base[:i] + draw(st.sampled_from(["x", "", "_", "."])) + base[i + 1 :]
    if kind == "absent layer":
        return f"blocks.{bridge.cfg.n_layers + draw(st.integers(0, 3))}.hook_out"
    if kind == "junk":
        return draw(st.text(max_size=12))
    return base


def check_name_property(bridge: Any, data: st.DataObject, full: Any) -> None:
    """A name resolves to the tensor its canonical name holds, or is refused before running."""
    name = data.draw(hook_names(bridge))
    prompts = [[5, 6, 7, 8], [9, 10]]
    got = outcome(
        bridge, lambda: bridge.run_with_cache(prompts, names_filter=[name], prepend_bos=False)
    )
    if isinstance(got, UserError):
        return
    _, cache = got
    canonical = bridge.namespace.lookup(name)
    # Capturing every site runs attention step by step, one site alone may take SDPA.
    torch.testing.assert_close(cache[name], full[canonical], atol=1e-5, rtol=1e-5, msg=name)


# -- token inputs ---------------------------------------------------------------------


@st.composite
def token_inputs(draw: st.DrawFn, vocab: int) -> Any:
    """Lists of id lists (ragged, empty, out of the vocabulary, non-int) or tensors."""
    ids = st.integers(-2, vocab + 2) if draw(st.integers(0, 4)) == 0 else st.integers(0, vocab - 1)
    rows = draw(st.lists(st.lists(ids, min_size=0, max_size=9), min_size=0, max_size=3))
    form = draw(
        st.sampled_from(["lists", "lists", "tensor", "float tensor", "rank 3", "floats", "none"])
    )
    if form == "tensor" and rows and len({len(r) for r in rows}) == 1:
        return torch.tensor(rows, dtype=torch.long)
    if form == "float tensor" and rows and len({len(r) for r in rows}) == 1:
        return torch.tensor(rows, dtype=torch.float32)
    if form == "rank 3" and rows and len({len(r) for r in rows}) == 1:
        return torch.tensor([rows], dtype=torch.long)
    if form == "floats" and rows and rows[0]:
        rows[0][0] = float(rows[0][0]) + 0.5
    if form == "none" and rows:
        rows[draw(st.integers(0, len(rows) - 1))] = None  # type: ignore[call-overload]
    return rows


def check_token_property(bridge: Any, data: st.DataObject, tolerance: float = 1e-5) -> None:
    """Ids are refused before running, or each prompt's logits equal its own run's."""
    raw = data.draw(token_inputs(bridge.cfg.d_vocab))
    got = outcome(bridge, lambda: bridge(raw, prepend_bos=False))
    if isinstance(got, UserError):
        return
    rows = raw.tolist() if isinstance(raw, torch.Tensor) else raw
    assume(rows)
    assert bool(torch.isfinite(torch.cat([got[b, : len(r)] for b, r in enumerate(rows)])).all()), (
        raw
    )
    for b, row in enumerate(rows):
        alone = bridge([row], prepend_bos=False)
        torch.testing.assert_close(
            got[b, : len(row)], alone[0], atol=tolerance, rtol=tolerance, msg=str(raw)
        )


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def bridge(request: pytest.FixtureRequest) -> TransformerBridge:
    return TransformerBridge.boot_native(request.param, n_layers=2)


@given(data=st.data())
@SETTINGS
def test_specs_run_as_written_or_are_refused_first(
    bridge: TransformerBridge, data: st.DataObject
) -> None:
    check_spec_property(bridge, data)


@given(data=st.data())
@SETTINGS
def test_hook_names_resolve_or_are_refused_first(
    bridge: TransformerBridge, data: st.DataObject
) -> None:
    _, full = bridge.run_with_cache([[5, 6, 7, 8], [9, 10]], prepend_bos=False)
    check_name_property(bridge, data, full)


@given(data=st.data())
@SETTINGS
def test_token_inputs_run_or_are_refused_first(
    bridge: TransformerBridge, data: st.DataObject
) -> None:
    check_token_property(bridge, data)
