"""Intervention specs: parsing, validation against a driver and a batch, compilation."""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tl_core import TransformerBridge
from tl_core._errors import HookNameError, SpecError, TLError
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._namespace import HookNamespace
from tl_core.specs._affine import AffineEdit, compile_plan, compile_specs
from tl_core.specs._plan import InterventionPlan, build_plan
from tl_core.specs._specs import (
    SPEC_JSON_SCHEMA,
    SPEC_OPS,
    InterventionSpec,
    parse_spec,
)

HOOK = "blocks.0.hook_out"
Z = "blocks.0.attn.hook_z"
SCALE_HOOK = "blocks.0.ln1.hook_scale"
PATTERN = "blocks.0.attn.hook_pattern"
# d_model 4, two heads of 3: hook_out is (4,), hook_z (2, 3), hook_scale (1,).
INFO = ModelInfo(
    n_layers=2, d_model=4, n_heads=2, d_head=3, d_mlp=8, d_vocab=10, n_ctx=16, architecture="tiny"
)
EDITABLE = frozenset({HOOK, "blocks.1.hook_out", Z, SCALE_HOOK, PATTERN})
READ_ONLY_REASON = "the engine reads it after a fused kernel"
# blocks.0.hook_in is served for capture only; blocks.0.mlp.hook_out is not served at all.
NAMESPACE = HookNamespace.build(
    INFO,
    EDITABLE | {"blocks.0.hook_in"},
    editable=EDITABLE,
    reasons={"blocks.0.hook_in": READ_ONLY_REASON, "blocks.0.mlp.hook_out": "fused MLP kernel"},
    driver="fake",
)


def plan_for(
    intervene: object,
    lengths: Sequence[int] = (5,),
    *,
    namespace: HookNamespace = NAMESPACE,
    allow_callables: bool = True,
) -> InterventionPlan:
    return build_plan(
        intervene, lengths=lengths, namespace=namespace, allow_callables=allow_callables
    )


def spec_error(raw: object, hook: str = HOOK) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(raw, hook=hook)
    return str(info.value)


def plan_error(intervene: object, lengths: Sequence[int] = (5,), **kwargs: Any) -> str:
    with pytest.raises(SpecError) as info:
        plan_for(intervene, lengths, **kwargs)
    return str(info.value)


def reference(x: torch.Tensor, specs: Sequence[InterventionSpec]) -> torch.Tensor:
    """Apply specs one by one, position by position, to ``x`` of shape (seq, *features)."""
    out = x.clone()
    seq, features = x.shape[0], tuple(x.shape[1:])
    for spec in specs:
        rows = list(range(seq)) if spec.pos is None else [p % seq for p in spec.pos]
        for k, row in enumerate(rows):
            value: Any = spec.value
            if spec.has_per_position_value:
                value = value[k]
            if isinstance(value, tuple):
                value = torch.tensor(value, dtype=x.dtype).reshape(features)
            if spec.op == "suppress":
                out[row] = 0.0
            elif spec.op == "scale":
                assert spec.factor is not None
                out[row] = out[row] * spec.factor
            elif spec.op == "add":
                out[row] = out[row] + value
            else:
                out[row] = torch.zeros_like(out[row]) + value
    return out


def apply_one(specs: Sequence[InterventionSpec], x: torch.Tensor) -> torch.Tensor:
    edit = compile_specs(
        specs,
        feature_shape=tuple(x.shape[1:]),
        seq_len=x.shape[0],
        dtype=x.dtype,
        device=x.device,
    )
    return edit.apply(x)


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"op": "suppress"}, InterventionSpec("suppress")),
        ({"op": "scale", "factor": 2}, InterventionSpec("scale", factor=2.0)),
        ({"op": "add", "value": 1}, InterventionSpec("add", value=1.0)),
        ({"op": "set", "value": [1, 2, 3, 4]}, InterventionSpec("set", value=(1.0, 2.0, 3.0, 4.0))),
        ({"op": "suppress", "pos": 3}, InterventionSpec("suppress", pos=(3,))),
        ({"op": "suppress", "pos": [-1, 0]}, InterventionSpec("suppress", pos=(-1, 0))),
        (
            {"op": "add", "value": [[1, 2], [3, 4]], "pos": [0, 2]},
            InterventionSpec("add", value=((1.0, 2.0), (3.0, 4.0)), pos=(0, 2)),
        ),
    ],
)
def test_parse_normalises_each_op(raw: dict[str, Any], expected: InterventionSpec) -> None:
    spec = parse_spec(raw, hook=HOOK)
    assert spec == expected
    assert spec.op == raw["op"]
    if spec.factor is not None:
        assert type(spec.factor) is float
    if isinstance(spec.value, tuple):
        flat = [v for row in spec.value for v in (row if isinstance(row, tuple) else (row,))]
        assert all(type(v) is float for v in flat)


def test_parse_accepts_tensors_arrays_and_spec_objects() -> None:
    from_tensor = parse_spec(
        {"op": "add", "value": torch.arange(4.0, requires_grad=True), "pos": torch.tensor([1])},
        hook=HOOK,
    )
    assert from_tensor == InterventionSpec("add", value=(0.0, 1.0, 2.0, 3.0), pos=(1,))
    from_array = parse_spec(
        {"op": "set", "value": np.ones((2, 4), dtype=np.float32), "pos": np.array([0, -1])},
        hook=HOOK,
    )
    assert from_array.value == ((1.0,) * 4,) * 2
    assert from_array.pos == (0, -1)
    assert parse_spec({"op": "scale", "factor": np.float32(0.5)}, hook=HOOK).factor == 0.5
    assert parse_spec({"op": "add", "value": torch.tensor(2.0)}, hook=HOOK).value == 2.0
    spec = InterventionSpec.scale(3.0)
    assert parse_spec(spec, hook=HOOK) is spec


def test_classmethod_constructors_match_parsed_mappings() -> None:
    assert InterventionSpec.suppress() == parse_spec({"op": "suppress"}, hook=HOOK)
    assert InterventionSpec.scale(0.5, pos=2) == parse_spec(
        {"op": "scale", "factor": 0.5, "pos": [2]}, hook=HOOK
    )
    assert InterventionSpec.add([1, 2], pos=None).value == (1.0, 2.0)
    assert InterventionSpec.set([[1], [2]], pos=[4, 5]) == parse_spec(
        {"op": "set", "value": [[1.0], [2.0]], "pos": [4, 5]}, hook=HOOK
    )
    assert hash(InterventionSpec.add([1, 2])) == hash(InterventionSpec.add((1.0, 2.0)))


def test_direct_construction_validates() -> None:
    with pytest.raises(SpecError, match="op 'scale' needs key 'factor'"):
        InterventionSpec("scale")
    with pytest.raises(SpecError, match="InterventionSpec: key 'factor' expects a real number"):
        InterventionSpec.scale(True)
    with pytest.raises(SpecError, match="key 'value' does not apply to op 'suppress'"):
        InterventionSpec("suppress", value=1.0)


EXAMPLES = [
    {"op": "suppress"},
    {"op": "suppress", "pos": [-2, 0, 7]},
    {"op": "scale", "factor": -0.25},
    {"op": "scale", "factor": 3, "pos": 1},
    {"op": "add", "value": 0.5},
    {"op": "add", "value": [0.1, -0.2, 0.3, 1e-9], "pos": [4]},
    {"op": "set", "value": [[1, 2], [3, 4], [5, 6]], "pos": [0, 1, -1]},
    {"op": "set", "value": -3.4028234663852886e38, "pos": 2},
    {"op": "suppress", "features": 7},
    {"op": "add", "value": [1.0, 2.0], "features": [3, 0], "pos": -1},
]


@pytest.mark.parametrize("raw", EXAMPLES)
def test_to_dict_round_trips_through_json(raw: dict[str, Any]) -> None:
    spec = parse_spec(raw, hook=HOOK)
    data = spec.to_dict()
    assert set(data) == set(raw)
    again = parse_spec(json.loads(json.dumps(data)), hook=HOOK)
    assert again == spec
    assert again.to_dict() == data


@pytest.mark.parametrize("raw", EXAMPLES)
def test_to_dict_output_satisfies_published_schema(raw: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(SPEC_JSON_SCHEMA)
    jsonschema.Draft202012Validator(SPEC_JSON_SCHEMA).validate(parse_spec(raw, hook=HOOK).to_dict())


@pytest.mark.parametrize(
    "raw",
    [
        {"op": "scale"},
        {"op": "scale", "factor": 1, "value": 2},
        {"op": "suppress", "factor": 1},
        {"op": "add", "value": [[1, 2]]},
        {"op": "add", "value": "x"},
        {"op": "add", "value": []},
        {"op": "set", "value": 1, "pos": []},
        {"op": "set", "value": 1, "pos": [1, 1]},
        {"op": "mute"},
        {"op": "suppress", "factr": 2},
        {"factor": 2},
        {"op": "scale", "factor": math.inf},
        {"op": "add", "value": 1e39},
        {"op": "set", "value": [0.0, -math.inf]},
        {"op": "add", "value": [[0.0], [-3.5e38]], "pos": [0, 1]},
        {"op": "suppress", "features": []},
        {"op": "suppress", "features": [-1]},
        {"op": "scale", "factor": 2, "features": [3, 3]},
        {"op": "add", "value": 1, "features": "3"},
    ],
)
def test_schema_and_validator_reject_the_same_specs(raw: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    with pytest.raises(SpecError):
        parse_spec(raw, hook=HOOK)
    assert not jsonschema.Draft202012Validator(SPEC_JSON_SCHEMA).is_valid(raw)


def test_published_schema_file_is_up_to_date() -> None:
    root = Path(__file__).resolve().parents[3]
    script = root / "scripts" / "write_spec_schema.py"
    if not script.exists():
        pytest.skip("outside the monorepo checkout: scripts/write_spec_schema.py is absent")
    module_spec = importlib.util.spec_from_file_location("write_spec_schema", script)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    path = root / "docs" / "intervention-spec.schema.json"
    assert path.exists(), "docs/intervention-spec.schema.json is missing; run " + str(script)
    assert path.read_text(encoding="utf-8") == module.render(), (
        "docs/intervention-spec.schema.json is stale; run python scripts/write_spec_schema.py"
    )
    assert json.loads(path.read_text(encoding="utf-8")) == SPEC_JSON_SCHEMA


def test_schema_has_one_branch_per_op_and_no_extra_keys() -> None:
    branches = SPEC_JSON_SCHEMA["oneOf"]
    assert [b["properties"]["op"]["const"] for b in branches] == list(SPEC_OPS)
    assert all(b["additionalProperties"] is False for b in branches)
    assert SPEC_JSON_SCHEMA["$schema"].endswith("2020-12/schema")


# --------------------------------------------------------------------------- spec errors


def test_unknown_key_names_hook_and_suggests() -> None:
    message = spec_error({"op": "scale", "factr": 2})
    assert message == (
        "intervention on 'blocks.0.hook_out': key 'factr' is not a spec key; did you mean "
        "'factor'? Spec keys: op, factor, value, pos, features"
    )


def test_unknown_op_suggests_nearest() -> None:
    message = spec_error({"op": "supress"})
    assert "intervention on 'blocks.0.hook_out'" in message
    assert "key 'op' is 'supress'" in message
    assert "did you mean 'suppress'?" in message
    assert "suppress, scale, add, set" in message
    assert "did you mean" not in spec_error({"op": "zzz"})
    assert "key 'op' is 3" in spec_error({"op": 3})


def test_missing_op_and_missing_factor_and_value() -> None:
    assert "has no key 'op'; expected one of suppress, scale, add, set" in spec_error({"factor": 2})
    message = spec_error({"op": "scale", "pos": 1})
    assert "op 'scale' needs key 'factor' (a real number), found none" in message
    assert "intervention on 'blocks.0.hook_out'" in message
    assert "op 'set' needs key 'value'" in spec_error({"op": "set"})


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"op": "scale", "factor": True}, "key 'factor' expects a real number, found bool True"),
        ({"op": "scale", "factor": "2"}, "key 'factor' expects a real number, found str '2'"),
        ({"op": "scale", "factor": math.nan}, "key 'factor' expects a real number, found NaN"),
        ({"op": "add", "value": "x"}, "key 'value' expects a number, a list of numbers"),
        ({"op": "add", "value": True}, "found bool True"),
        ({"op": "add", "value": [1, False]}, "found element bool False"),
        ({"op": "add", "value": [1, [2]]}, "found element list [2]"),
        ({"op": "add", "value": []}, "found an empty list"),
        ({"op": "add", "value": [1, 2j]}, "found element complex 2j"),
        ({"op": "suppress", "value": 1}, "key 'value' does not apply to op 'suppress'"),
        ({"op": "add", "factor": 1, "value": 1}, "op 'add' takes keys op, value, pos"),
        ({"op": "suppress", "pos": 1.5}, "key 'pos' expects an int or a non-empty list"),
        ({"op": "suppress", "pos": True}, "found bool True"),
        ({"op": "suppress", "pos": []}, "found an empty list; omit 'pos'"),
        ({"op": "suppress", "pos": [2, 3, 2]}, "key 'pos' lists position 2 more than once"),
        (
            {"op": "add", "value": [[1, 2], [3, 4]]},
            "key 'value' is a list of 2 vectors (one per position) but the spec has no key 'pos'",
        ),
        (
            {"op": "add", "value": [[1, 2], [3, 4]], "pos": [1, 2, 3]},
            "key 'value' has 2 per-position vectors but key 'pos' lists 3 position(s) [1, 2, 3]",
        ),
        (
            {"op": "set", "value": [[1, 2], [3]], "pos": [1, 2]},
            "per-position vectors of different widths: 2 (entry 0) and 1 (entry 1)",
        ),
    ],
)
def test_malformed_values_name_key_expected_and_found(raw: object, fragment: str) -> None:
    message = spec_error(raw, hook="blocks.3.mlp.hook_post")
    assert message.startswith("intervention on 'blocks.3.mlp.hook_post': ")
    assert fragment in message


def test_non_mapping_spec() -> None:
    message = spec_error("suppress")
    assert "expected a spec (a mapping with an 'op' key, or an InterventionSpec)" in message
    assert "found str 'suppress'; write {'op': 'suppress'}" in message
    assert "found int 3" in spec_error(3)


def test_integral_float_positions_are_accepted_like_json_integers() -> None:
    assert parse_spec({"op": "suppress", "pos": [2.0, -1.0]}, hook=HOOK).pos == (2, -1)


# --------------------------------------------------------------------------- non-finite numbers

F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        ({"op": "add", "value": math.inf}, ["key 'value' expects a finite number, found inf"]),
        ({"op": "set", "value": -math.inf}, ["key 'value' expects a finite number, found -inf"]),
        ({"op": "scale", "factor": math.inf}, ["key 'factor' expects a finite number, found inf"]),
        ({"op": "scale", "factor": -math.inf}, ["key 'factor'", "found -inf"]),
        ({"op": "add", "value": [0.5, 1.0, math.inf, 2.0]}, ["key 'value'", "inf at index [2]"]),
        ({"op": "add", "value": [0.0, math.nan]}, ["key 'value'", "found NaN at index [1]"]),
        (
            {"op": "set", "value": [[1, 2], [3, -math.inf]], "pos": [0, 1]},
            ["key 'value'", "found -inf at index [1][1]"],
        ),
        ({"op": "add", "value": 1e39}, ["key 'value' is 1e+39", "overflows float32"]),
        ({"op": "set", "value": -1e39}, ["key 'value' is -1e+39", "overflows float32"]),
        ({"op": "scale", "factor": 3.5e38}, ["key 'factor' is 3.5e+38", "overflows float32"]),
        ({"op": "scale", "factor": -1e300}, ["key 'factor'", "overflows float32"]),
        (
            {"op": "add", "value": [1.0, 1e39, math.inf]},
            ["key 'value' has 1e+39 at index [1]", "overflows float32"],
        ),
        (
            {"op": "add", "value": [[1.0, 2.0], [2e38, 2e38 * 2]], "pos": [0, 1]},
            ["key 'value' has 4e+38 at index [1][1]", "overflows float32"],
        ),
        ({"op": "add", "value": 10**400}, ["key 'value'", "overflows float32"]),
        ({"op": "add", "value": [0, -(10**400)]}, ["index [1]", "overflows float32"]),
        ({"op": "add", "value": torch.tensor([0.0, math.inf])}, ["found inf at index [1]"]),
        (
            {"op": "add", "value": np.array([[0.0], [1e39]]), "pos": [0, 1]},
            ["key 'value' has 1e+39 at index [1][0]", "overflows float32"],
        ),
    ],
)
def test_non_finite_and_float32_overflowing_numbers_are_refused(
    raw: dict[str, Any], fragments: list[str]
) -> None:
    message = spec_error(raw, hook="blocks.3.mlp.hook_post")
    assert message.startswith("intervention on 'blocks.3.mlp.hook_post': ")
    for fragment in fragments:
        assert fragment in message


def test_overflow_message_names_float32_and_its_limit() -> None:
    message = spec_error({"op": "add", "value": 1e39})
    assert "overflows float32 (the model's dtype" in message
    assert "3.4028235e+38" in message


def test_constructors_refuse_non_finite_numbers() -> None:
    with pytest.raises(SpecError, match=r"InterventionSpec: key 'factor' expects a finite"):
        InterventionSpec.scale(-math.inf)
    with pytest.raises(SpecError, match=r"InterventionSpec: key 'value' .*overflows float32"):
        InterventionSpec.add(1e39)
    with pytest.raises(SpecError, match=r"InterventionSpec: .*found inf at index \[3\]"):
        InterventionSpec.set(torch.tensor([0.0, 1.0, 2.0, math.inf]))


@pytest.mark.parametrize("number", [F32_MAX, -F32_MAX, 1e38, -3e38, 1e-45, 0.0])
def test_every_float32_magnitude_is_accepted(number: float) -> None:
    assert parse_spec({"op": "scale", "factor": number}, hook=HOOK).factor == number
    assert parse_spec({"op": "set", "value": [number, 1.0]}, hook=HOOK).value == (number, 1.0)


def test_non_finite_specs_fail_before_running() -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=2)
    calls: list[int] = []
    with bridge.hooks([("embed.hook_out", lambda x, hook: calls.append(1))]):
        for spec in (
            {"op": "add", "value": math.inf},
            {"op": "scale", "factor": -math.inf},
            {"op": "set", "value": 1e39},
            {"op": "add", "value": [0.0] * 63 + [math.inf]},
        ):
            with pytest.raises(SpecError, match=r"'blocks\.0\.hook_out'"):
                bridge("Finite edits only", intervene={"blocks.0.hook_out": spec})
    assert calls == []


_HUGE = st.sampled_from(
    [1e39, -1e39, 1e300, -1e300, 3.5e38, F32_MAX, -F32_MAX, 3.4028236e38, 10**400]
)
_NUMBERS = st.floats(allow_nan=True, allow_infinity=True) | _HUGE


@st.composite
def _numeric_specs(draw: st.DrawFn, width: int) -> dict[str, Any]:
    """One spec with its numeric fields drawn from any floats, huge ones included."""

    def vector() -> list[Any]:
        base = draw(st.floats(-10.0, 10.0))
        out: list[Any] = [base] * width
        out[draw(st.integers(0, width - 1))] = draw(_NUMBERS)
        return out

    kind = draw(st.sampled_from(["factor", "scalar", "vector", "per-position"]))
    if kind == "factor":
        return {"op": "scale", "factor": draw(_NUMBERS)}
    op = draw(st.sampled_from(["add", "set"]))
    if kind == "scalar":
        return {"op": op, "value": draw(_NUMBERS)}
    if kind == "vector":
        return {"op": op, "value": vector()}
    return {"op": op, "value": [vector(), vector()], "pos": [0, -1]}


@pytest.fixture(scope="module")
def llama_bridge() -> TransformerBridge:
    return TransformerBridge.boot_native("llama", n_layers=2)


@given(data=st.data())
@settings(max_examples=50, deadline=None)
def test_any_numeric_spec_is_refused_or_gives_finite_logits(
    llama_bridge: TransformerBridge, data: st.DataObject
) -> None:
    spec = data.draw(_numeric_specs(llama_bridge.cfg.d_model))
    calls: list[int] = []
    with llama_bridge.hooks([("embed.hook_out", lambda x, hook: calls.append(1))]):
        try:
            logits = llama_bridge("Finite edits only", intervene={"blocks.0.hook_out": spec})
        except SpecError as error:
            assert calls == [], f"{spec} was refused only after the forward started"
            assert "'blocks.0.hook_out'" in str(error)
            return
    assert bool(torch.isfinite(logits).all()), f"{spec} was accepted but gave non-finite logits"


# --------------------------------------------------------------------------- plans


def test_empty_plans() -> None:
    plan = plan_for(None, lengths=(3, 4))
    assert plan.is_empty and plan.hooks == frozenset()
    assert plan.per_prompt == ({}, {})
    assert plan.specs_for(HOOK) == ((), ())
    assert plan_for({HOOK: []}).is_empty
    assert plan_for([None, {}], lengths=(2, 2)).is_empty


def test_shared_mapping_resolves_names_and_negative_positions_per_prompt() -> None:
    plan = plan_for(
        {
            "blocks.0.hook_resid_post": {"op": "add", "value": [1, 2, 3, 4], "pos": -1},
            Z: [{"op": "scale", "factor": 2}, InterventionSpec.suppress(pos=[0, -2])],
        },
        lengths=(3, 5),
    )
    assert plan.hooks == {HOOK, Z}
    assert not plan.is_empty
    assert plan.lengths == (3, 5)
    assert [s[0].pos for s in plan.specs_for(HOOK)] == [(2,), (4,)]
    assert [s[1].pos for s in plan.specs_for(Z)] == [(0, 1), (0, 3)]
    assert plan.specs_for(Z)[0][0] == InterventionSpec.scale(2.0)
    assert plan.specs_for("blocks.1.hook_out") == ((), ())


def test_alias_and_canonical_spellings_merge_in_order_given() -> None:
    first, second, third = (InterventionSpec.scale(f) for f in (2.0, 3.0, 5.0))
    plan = plan_for({HOOK: first, "blocks.0.hook_resid_post": [second, third]})
    assert plan.specs_for(HOOK) == ((first, second, third),)
    plan = plan_for({"blocks.0.hook_resid_post": third, HOOK: first})
    assert plan.specs_for(HOOK) == ((third, first),)


def test_per_prompt_list_with_none_entries() -> None:
    plan = plan_for(
        [{HOOK: {"op": "suppress"}}, None, {"blocks.0.hook_resid_post": {"op": "add", "value": 1}}],
        lengths=(2, 3, 4),
    )
    assert plan.specs_for(HOOK) == (
        (InterventionSpec.suppress(),),
        (),
        (InterventionSpec.add(1.0),),
    )


def test_per_prompt_list_must_match_batch_size() -> None:
    message = plan_error([{HOOK: {"op": "suppress"}}] * 3, lengths=(4, 4))
    assert "list of 3 per-prompt mappings but the batch has 2 prompt(s)" in message
    assert "one mapping (or None) per prompt" in message


def test_bad_intervene_containers() -> None:
    assert "found str 'blocks.0.hook_out'" in plan_error(HOOK)
    assert "found int 3" in plan_error(3)
    message = plan_error([{HOOK: {"op": "suppress"}}, 7], lengths=(2, 2))
    assert "intervene[1]: expected a mapping of hook name to specs or None for prompt 1" in message
    assert "hook names must be strings, found int 0" in plan_error({0: {"op": "suppress"}})


def test_spec_errors_in_plans_name_hook_and_prompt() -> None:
    message = plan_error([None, {HOOK: {"op": "scale", "factor": False}}], lengths=(2, 2))
    assert message.startswith("intervention on 'blocks.0.hook_out' for prompt 1: ")
    assert "found bool False" in message
    assert "write {'op': 'suppress'}" in plan_error({HOOK: [{"op": "add", "value": 1}, "suppress"]})


def test_unknown_hook_name_raises_hook_name_error() -> None:
    with pytest.raises(HookNameError, match=r"unknown hook name 'blocks\.1\.nope'"):
        plan_for({"blocks.1.nope": {"op": "suppress"}})
    with pytest.raises(HookNameError, match=r"names block 9, but this tiny has 2 blocks"):
        plan_for({"blocks.9.hook_out": {"op": "suppress"}})


def test_read_only_hook_names_the_reason_and_suggests_editable_hooks() -> None:
    message = plan_error({"blocks.0.hook_resid_pre": {"op": "suppress"}})
    assert message.startswith(
        "intervention on 'blocks.0.hook_resid_pre' ('blocks.0.hook_in'): driver 'fake' "
        f"cannot edit it: {READ_ONLY_REASON}."
    )
    assert "Did you mean 'blocks.0.hook_out'" in message


def test_unserved_hook_is_a_hook_name_error_with_the_drivers_reason() -> None:
    with pytest.raises(HookNameError) as info:
        plan_for({"blocks.0.hook_mlp_out": {"op": "suppress"}})
    assert str(info.value) == (
        "driver 'fake' cannot fire 'blocks.0.hook_mlp_out' ('blocks.0.mlp.hook_out'): "
        "fused MLP kernel"
    )
    with pytest.raises(HookNameError, match="driver 'fake' does not serve it"):
        plan_for({"blocks.1.attn.hook_q": {"op": "suppress"}})


def test_callables_are_kept_when_allowed() -> None:
    def double(x: torch.Tensor, *, hook: Any) -> torch.Tensor:
        return x * 2

    def negate(x: torch.Tensor, *, hook: Any) -> torch.Tensor:
        return -x

    plan = plan_for(
        {"blocks.0.hook_resid_post": double, HOOK: [negate], Z: {"op": "suppress"}},
        lengths=(2, 3),
    )
    assert plan.callables == {HOOK: (double, negate)}
    assert plan.hooks == {HOOK, Z}
    assert plan.specs_for(HOOK) == ((), ())


def test_callables_refused_by_declarative_drivers() -> None:
    def hook_fn(x: torch.Tensor, *, hook: Any) -> torch.Tensor:
        return x

    message = plan_error({HOOK: hook_fn}, allow_callables=False)
    assert message.startswith("intervention on 'blocks.0.hook_out': ")
    assert "this driver takes declarative specs only, found Python function" in message
    assert "spec ops: suppress, scale, add, set" in message
    assert "{'op': 'scale', 'factor': f}" in message


def test_callables_not_in_per_prompt_lists_nor_mixed_with_specs() -> None:
    def hook_fn(x: torch.Tensor, *, hook: Any) -> torch.Tensor:
        return x

    message = plan_error([{HOOK: hook_fn}, None], lengths=(2, 2))
    assert "for prompt 0: Python hook functions apply to the whole batch" in message
    message = plan_error({HOOK: [hook_fn, {"op": "suppress"}]})
    assert "holds either specs or Python hook functions, not both" in message


@pytest.mark.parametrize(
    ("hook", "spec", "fragment"),
    [
        (HOOK, {"op": "add", "value": [1.0] * 5}, "key 'value' has width 5, expected 4 "),
        (Z, {"op": "set", "value": [0.0] * 3}, "has width 3, expected 6 (the hook's feature"),
        (SCALE_HOOK, {"op": "set", "value": [1, 2]}, "has width 2, expected 1"),
        (
            HOOK,
            {"op": "add", "value": [[1.0] * 3, [1.0] * 3], "pos": [0, 1]},
            "has width 3, expected 4",
        ),
    ],
)
def test_wrong_width_says_expected_and_found(hook: str, spec: object, fragment: str) -> None:
    message = plan_error({hook: spec})
    assert message.startswith(f"intervention on {hook!r}: ")
    assert fragment in message
    assert "pass a scalar, a" in message


def test_pattern_width_is_each_prompts_length() -> None:
    plan = plan_for(
        [{PATTERN: {"op": "set", "value": [0.5] * 3}}, {PATTERN: {"op": "add", "value": [1] * 4}}],
        lengths=(3, 4),
    )
    assert [len(s[0].value) for s in plan.specs_for(PATTERN)] == [3, 4]  # type: ignore[arg-type]
    message = plan_error({PATTERN: {"op": "set", "value": [0.5] * 3}}, lengths=(3, 4))
    assert "for prompt 1: key 'value' has width 3, expected the prompt's length 4" in message


@pytest.mark.parametrize(("pos", "bad"), [(5, 5), ([0, 6], 6), (-6, -6)])
def test_position_out_of_range_names_prompt_and_length(pos: object, bad: int) -> None:
    message = plan_error({HOOK: {"op": "suppress", "pos": pos}}, lengths=(7, 5))
    assert message == (
        f"intervention on 'blocks.0.hook_out' for prompt 1: key 'pos' lists position {bad}, "
        "out of range for a prompt of length 5 (valid positions: -5..4)"
    )


def test_positions_that_meet_after_resolution_are_duplicates() -> None:
    message = plan_error({HOOK: {"op": "suppress", "pos": [-1, 3]}}, lengths=(5, 4))
    assert "for prompt 1: key 'pos' [-1, 3] names one position twice" in message
    assert "length 4 (as [3, 3])" in message


# --------------------------------------------------------------------------- compilation


CASES: list[list[dict[str, Any]]] = [
    [{"op": "suppress"}],
    [{"op": "scale", "factor": -1.5}],
    [{"op": "add", "value": 0.25}],
    [{"op": "set", "value": 2.0}],
    [{"op": "add", "value": [1, 2, 3, 4]}],
    [{"op": "set", "value": [1, 2, 3, 4]}],
    [{"op": "suppress", "pos": 2}],
    [{"op": "scale", "factor": 3, "pos": [0, -1]}],
    [{"op": "add", "value": [1, 2, 3, 4], "pos": [1, 3]}],
    [{"op": "set", "value": [[1, 2, 3, 4], [5, 6, 7, 8]], "pos": [-2, 0]}],
    [{"op": "add", "value": [[1, 1, 1, 1], [2, 2, 2, 2]], "pos": [4, 1]}],
    [{"op": "scale", "factor": 2}, {"op": "add", "value": [1, 0, 0, 1], "pos": 1}],
    [{"op": "set", "value": 1, "pos": [0, 1]}, {"op": "scale", "factor": 0.5}],
    [{"op": "add", "value": [[9, 9, 9, 9]], "pos": 3}, {"op": "suppress", "pos": [2, 3]}],
]


@pytest.mark.parametrize("raw_specs", CASES)
def test_compiled_edit_matches_direct_computation(raw_specs: list[dict[str, Any]]) -> None:
    specs = [parse_spec(raw, hook=HOOK) for raw in raw_specs]
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(apply_one(specs, x), reference(x, specs))


def test_composition_order_matters() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    scale_then_add = [InterventionSpec.scale(3.0), InterventionSpec.add(1.0)]
    add_then_scale = [InterventionSpec.add(1.0), InterventionSpec.scale(3.0)]
    torch.testing.assert_close(apply_one(scale_then_add, x), x * 3 + 1)
    torch.testing.assert_close(apply_one(add_then_scale, x), (x + 1) * 3)
    assert not torch.allclose(apply_one(scale_then_add, x), apply_one(add_then_scale, x))
    set_then_add = [InterventionSpec.set(2.0, pos=1), InterventionSpec.add(1.0)]
    add_then_set = list(reversed(set_then_add))
    assert torch.all(apply_one(set_then_add, x)[1] == 3.0)
    assert torch.all(apply_one(add_then_set, x)[1] == 2.0)
    torch.testing.assert_close(apply_one(add_then_set, x)[0], x[0] + 1)


def test_compiled_shapes_stay_small_without_positions() -> None:
    kwargs: dict[str, Any] = {"seq_len": 7, "dtype": torch.float32, "device": "cpu"}
    scalar = compile_specs([InterventionSpec.scale(2.0)], feature_shape=(2, 3), **kwargs)
    assert scalar.scale.shape == () and scalar.bias.shape == ()
    vector = compile_specs([InterventionSpec.add([1.0] * 6)], feature_shape=(2, 3), **kwargs)
    assert vector.scale.shape == (2, 3) and vector.bias.shape == (2, 3)
    assert vector.bias[1, 2] == 1.0
    positioned = compile_specs([InterventionSpec.suppress(pos=0)], feature_shape=(2, 3), **kwargs)
    assert positioned.scale.shape == (7, 2, 3)
    assert compile_specs([], feature_shape=(4,), **kwargs).scale.shape == ()


def test_multi_axis_features_take_flat_vectors() -> None:
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(2))
    value = list(range(6))
    specs = [InterventionSpec.set(value, pos=1), InterventionSpec.add([[1.0] * 6], pos=[2])]
    out = apply_one(specs, x)
    torch.testing.assert_close(out[1], torch.arange(6.0).reshape(2, 3))
    torch.testing.assert_close(out[2], x[2] + 1)
    torch.testing.assert_close(out, reference(x, specs))


def test_compile_specs_checks_width_and_range() -> None:
    kwargs: dict[str, Any] = {"dtype": torch.float32, "device": "cpu"}
    with pytest.raises(SpecError, match="key 'value' has width 3, expected 4"):
        compile_specs([InterventionSpec.add([1, 2, 3])], feature_shape=(4,), seq_len=2, **kwargs)
    with pytest.raises(SpecError, match="position 2, out of range for 2 position"):
        compile_specs([InterventionSpec.suppress(pos=2)], feature_shape=(4,), seq_len=2, **kwargs)
    with pytest.raises(SpecError, match="names one position twice"):
        compile_specs([InterventionSpec.suppress([1, -1])], feature_shape=(4,), seq_len=2, **kwargs)


def test_set_and_suppress_are_exact_on_infinite_activations() -> None:
    x = torch.tensor([[-math.inf, 1.0], [math.inf, 2.0]])
    out = apply_one([InterventionSpec.set(-5.0, pos=0), InterventionSpec.suppress(pos=1)], x)
    assert torch.equal(out, torch.tensor([[-5.0, -5.0], [0.0, 0.0]]))
    kept = apply_one([InterventionSpec.add(1.0, pos=1)], x)
    assert kept[0, 0] == -math.inf and kept[1, 0] == math.inf


def test_apply_keeps_gradients() -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    specs = [InterventionSpec.scale(3.0), InterventionSpec.add([1, 2, 3, 4], pos=0)]
    edit = compile_specs(specs, feature_shape=(4,), seq_len=3, dtype=torch.float64, device="cpu")
    (edit.apply(x) ** 2).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 2 * (3 * x.detach() + edit.bias) * 3)
    assert torch.autograd.gradcheck(
        edit.apply, (torch.randn(3, 4, dtype=torch.float64, requires_grad=True),)
    )


def test_gradient_is_zero_where_values_are_set() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    specs = [InterventionSpec.set(1.0, pos=1), InterventionSpec.scale(2.0, pos=[0, 1])]
    edit = compile_specs(specs, feature_shape=(4,), seq_len=3, dtype=torch.float32, device="cpu")
    edit.apply(x).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.tensor([[2.0] * 4, [0.0] * 4, [1.0] * 4]))


def test_apply_follows_input_dtype() -> None:
    edit = compile_specs(
        [InterventionSpec.add([0.5] * 4)],
        feature_shape=(4,),
        seq_len=2,
        dtype=torch.bfloat16,
        device="cpu",
    )
    assert edit.scale.dtype == torch.bfloat16
    x = torch.ones(2, 2, 4, dtype=torch.bfloat16)
    out = edit.apply(x)
    assert out.dtype == torch.bfloat16 and torch.all(out == 1.5)
    assert isinstance(edit, AffineEdit)


# --------------------------------------------------------------------------- batch compilation


def padded(rows: Sequence[torch.Tensor], seq_len: int, offsets: Sequence[int]) -> torch.Tensor:
    """Stack per-prompt tensors (len, *f) into (batch, seq_len, *f) at the given offsets."""
    out = torch.full((len(rows), seq_len, *rows[0].shape[1:]), 7.0)
    for b, (row, offset) in enumerate(zip(rows, offsets, strict=True)):
        out[b, offset : offset + row.shape[0]] = row
    return out


def compile_batch(plan: InterventionPlan, hook: str, **kwargs: Any) -> AffineEdit | None:
    defaults: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "layout": "b p d"}
    return compile_plan(plan, hook, **{**defaults, **kwargs})


def test_compile_plan_returns_none_without_specs() -> None:
    plan = plan_for({Z: {"op": "suppress"}}, lengths=(3, 3))
    assert compile_batch(plan, HOOK, feature_shape=(4,), seq_len=3, offsets=None) is None


def test_shared_specs_without_positions_compile_to_a_broadcast_edit() -> None:
    plan = plan_for(
        {HOOK: [{"op": "scale", "factor": 2}, {"op": "add", "value": [1, 2, 3, 4]}]}, lengths=(2, 4)
    )
    edit = compile_batch(plan, HOOK, feature_shape=(4,), seq_len=4, offsets=[2, 0])
    assert edit is not None and edit.bias.shape == (4,)
    x = torch.randn(2, 4, 4)
    torch.testing.assert_close(edit.apply(x), x * 2 + torch.tensor([1.0, 2, 3, 4]))


@pytest.mark.parametrize("side", ["left", "right"])
def test_ragged_per_prompt_plan_matches_each_unpadded_prompt(side: str) -> None:
    lengths = (3, 5, 2, 4)
    seq_len = max(lengths)
    offsets = [seq_len - n for n in lengths] if side == "left" else [0] * len(lengths)
    intervene = [
        {HOOK: [{"op": "scale", "factor": 2}, {"op": "add", "value": [1, 2, 3, 4], "pos": -1}]},
        None,
        {"blocks.0.hook_resid_post": {"op": "set", "value": [[5] * 4, [6] * 4], "pos": [1, 0]}},
        {HOOK: {"op": "suppress", "pos": [0, -2]}},
    ]
    plan = plan_for(intervene, lengths=lengths)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(n, 4, generator=gen) for n in lengths]
    x = padded(rows, seq_len, offsets)
    edit = compile_batch(plan, HOOK, feature_shape=(4,), seq_len=seq_len, offsets=offsets)
    assert edit is not None and edit.scale.shape == (4, seq_len, 4)
    out = edit.apply(x)
    for b, (row, offset, specs) in enumerate(zip(rows, offsets, plan.specs_for(HOOK), strict=True)):
        got = out[b, offset : offset + lengths[b]]
        torch.testing.assert_close(got, reference(row, specs), msg=f"prompt {b}")
    torch.testing.assert_close(out[1], x[1])  # a prompt without specs is untouched


def test_per_prompt_plan_on_multi_axis_hook() -> None:
    plan = plan_for(
        [{Z: {"op": "add", "value": list(range(6)), "pos": 0}}, {Z: {"op": "scale", "factor": 0}}],
        lengths=(2, 3),
    )
    x = torch.randn(2, 3, 2, 3)
    edit = compile_batch(
        plan, Z, layout="b p h dh", feature_shape=(2, 3), seq_len=3, offsets=[1, 0]
    )
    assert edit is not None
    out = edit.apply(x)
    torch.testing.assert_close(out[0, 1], x[0, 1] + torch.arange(6.0).reshape(2, 3))
    torch.testing.assert_close(out[0, 2], x[0, 2])
    assert torch.all(out[1] == 0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_attention_pattern_edits_stay_inside_each_prompt(side: str) -> None:
    lengths = (2, 4, 3)
    seq_len, heads = 4, 2
    offsets = [seq_len - n for n in lengths] if side == "left" else [0, 0, 0]
    intervene = [
        {PATTERN: {"op": "set", "value": [0.25, 0.75]}},
        {PATTERN: [{"op": "scale", "factor": 2}, {"op": "add", "value": [1, 0, 0, 1], "pos": -1}]},
        {PATTERN: {"op": "suppress", "pos": [0]}},
    ]
    plan = plan_for(intervene, lengths=lengths)
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(3, heads, seq_len, seq_len, generator=gen)
    edit = compile_batch(
        plan, PATTERN, layout="b h q k", feature_shape=(seq_len,), seq_len=seq_len, offsets=offsets
    )
    assert edit is not None and edit.scale.shape == (3, 1, seq_len, seq_len)
    out = edit.apply(x)
    for b, (n, o, specs) in enumerate(zip(lengths, offsets, plan.specs_for(PATTERN), strict=True)):
        for h in range(heads):
            block = x[b, h, o : o + n, o : o + n]
            torch.testing.assert_close(out[b, h, o : o + n, o : o + n], reference(block, specs))
        outside = torch.ones(seq_len, dtype=torch.bool)
        outside[o : o + n] = False
        torch.testing.assert_close(out[b][..., outside], x[b][..., outside])  # padding keys


def test_shared_pattern_specs_broadcast_when_unpadded() -> None:
    plan = plan_for({PATTERN: {"op": "add", "value": [1, 2, 3]}}, lengths=(3, 3))
    edit = compile_batch(
        plan, PATTERN, layout="b h q k", feature_shape=(3,), seq_len=3, offsets=None
    )
    assert edit is not None and edit.bias.shape == (3,)
    x = torch.zeros(2, 2, 3, 3)
    assert torch.equal(edit.apply(x)[1, 1, 2], torch.tensor([1.0, 2.0, 3.0]))


def test_generated_positions_take_specs_without_pos() -> None:
    # A full recomputation during generation: the prompt (length 2, offset 1) has grown by 2.
    plan = plan_for(
        [{HOOK: {"op": "suppress"}}, {HOOK: {"op": "add", "value": 1, "pos": 0}}], lengths=(2, 3)
    )
    edit = compile_batch(plan, HOOK, feature_shape=(4,), seq_len=5, offsets=[1, 0])
    assert edit is not None
    out = edit.apply(torch.ones(2, 5, 4))
    assert torch.all(out[0, 1:] == 0) and torch.all(out[0, 0] == 1)
    assert torch.all(out[1, 0] == 2) and torch.all(out[1, 1:] == 1)


def test_compile_plan_checks_layout_and_offsets() -> None:
    plan = plan_for([{HOOK: {"op": "suppress", "pos": 0}}, None], lengths=(2, 2))
    with pytest.raises(TLError, match="layout 'b q d' does not fit feature_shape"):
        compile_batch(plan, HOOK, layout="b q d", feature_shape=(4,), seq_len=2, offsets=None)
    with pytest.raises(TLError, match=r"needs feature_shape \(2,\)"):
        compile_batch(plan, HOOK, layout="b h q k", feature_shape=(4,), seq_len=2, offsets=None)
    with pytest.raises(TLError, match=r"offsets \[0\] do not fit a batch of 2"):
        compile_batch(plan, HOOK, feature_shape=(4,), seq_len=2, offsets=[0])


def test_compiled_batch_gradients_flow() -> None:
    plan = plan_for(
        [{HOOK: {"op": "scale", "factor": 3, "pos": 1}}, {HOOK: {"op": "set", "value": 0}}],
        lengths=(2, 2),
    )
    edit = compile_batch(plan, HOOK, feature_shape=(4,), seq_len=2, offsets=None)
    assert edit is not None
    x = torch.randn(2, 2, 4, requires_grad=True)
    edit.apply(x).sum().backward()
    assert x.grad is not None
    expected = torch.tensor([[1.0, 3.0], [0.0, 0.0]])[..., None].expand(2, 2, 4)
    torch.testing.assert_close(x.grad, expected)


def test_specs_and_plans_pickle_for_worker_processes() -> None:
    import pickle

    plan = plan_for({HOOK: [{"op": "add", "value": [1, 2, 3, 4], "pos": -1}]}, lengths=(3,))
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan
    assert again.specs_for(HOOK)[0][0].pos == (2,)


@pytest.mark.parametrize(
    "spec",
    [
        {"op": "suppress"},
        {"op": "scale", "factor": 0.0, "pos": -1},
        {"op": "scale", "factor": 2.5e-23},  # a divisor that underflows the block to inf/NaN
        {"op": "set", "value": 0.0},
        {"op": "set", "value": 1e-9},
        {"op": "set", "value": -1.0, "pos": [0]},
        {"op": "set", "value": [[2.0], [0.0]], "pos": [0, 1]},
    ],
)
def test_an_edit_that_zeroes_a_norm_divisor_is_refused(spec: dict[str, Any]) -> None:
    """hook_scale divides the norm's input: zero (or a sign flip) is refused before running."""
    bridge = TransformerBridge.boot_native("gpt2", n_layers=2)
    calls: list[int] = []
    with bridge.hooks([("embed.hook_out", lambda x, hook: calls.append(1))]):
        with pytest.raises(
            SpecError, match=r"hook_scale is the divisor .* edit hook_normalized instead"
        ):
            bridge("Divide by what?", intervene={"blocks.0.ln2.hook_scale": spec})
    assert calls == []
    kept = bridge(
        "Divide by what?", intervene={"blocks.0.ln2.hook_scale": {"op": "scale", "factor": 2.0}}
    )
    assert bool(torch.isfinite(kept).all())


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 12), data=st.data())
def test_absolute_positions_count_negatives_from_the_end_and_refuse_the_rest(
    length: int, data: st.DataObject
) -> None:
    from tl_core.driver_api import absolute_positions

    positions = data.draw(st.lists(st.integers(-length - 3, length + 2), min_size=1, max_size=6))
    inside = all(-length <= p < length for p in positions)
    resolved = [p % length for p in positions] if inside else []
    if inside and len(set(resolved)) == len(resolved):
        assert absolute_positions(positions, length) == tuple(resolved)
    else:
        with pytest.raises(
            SpecError, match="out of range" if not inside else "names one position twice"
        ):
            absolute_positions(positions, length, where="here")
