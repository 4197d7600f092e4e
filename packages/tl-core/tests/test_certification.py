"""Certification arithmetic: ``compare``, ``equation_checks``, ``statuses_from_checks`` and
the report's text, on synthetic captures built to satisfy (or break) each equation."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tl_core import ModelInfo
from tl_core.certification import (
    CERTIFIED_STATUSES,
    Certification,
    CertificationCheck,
    HookCertificate,
    compare,
    compare_differs,
    equation_checks,
    silent_hook_checks,
    statuses_from_checks,
)

SETTINGS = settings(max_examples=30, deadline=None)
Form = Literal["sequential", "parallel", "sandwich", "post_ln"]

# -- compare --------------------------------------------------------------------------


@SETTINGS
@given(
    values=st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=12),
    rtol=st.sampled_from([1e-5, 1e-4, 1e-2]),
    factor=st.one_of(st.floats(0.0, 0.98), st.floats(1.02, 10.0)),
    where=st.integers(0, 11),
)
def test_compare_allows_rtol_of_the_larger_of_1_and_the_reference(
    values: list[float], rtol: float, factor: float, where: int
) -> None:
    want = torch.tensor(values, dtype=torch.float64)
    allowed = rtol * max(1.0, float(want.abs().max()))
    got = want.clone()
    got[where % len(values)] += factor * allowed
    check = compare("a == b", ("a",), got, want, rtol=rtol)
    assert check.passed is (factor < 1)
    assert check.allowed == pytest.approx(allowed)
    assert check.error == pytest.approx(factor * allowed, rel=1e-6, abs=1e-12)
    assert check.hooks == ("a",) and check.detail == ""


def test_compare_refuses_a_shape_mismatch_a_missing_side_and_non_finite_values() -> None:
    a = torch.zeros(2, 3)
    shape = compare("x == y", ["x"], a, torch.zeros(3, 2), rtol=1e-4)
    assert (
        not shape.passed
        and math.isinf(shape.error)
        and shape.detail == "shapes differ: (2, 3) vs (3, 2)"
    )
    for got, want in ((None, a), (a, None), (None, None)):
        missing = compare("x == y", ["x"], got, want, rtol=1e-4)
        assert not missing.passed and math.isinf(missing.error)
        assert missing.detail == "a hook on one side never fired"
    for bad in (math.nan, math.inf, -math.inf):
        b = a.clone()
        b[1, 2] = bad
        for got, want in ((b, a), (a, b)):
            check = compare("x == y", ["x"], got, want, rtol=1e-4)
            assert (
                not check.passed
                and math.isinf(check.error)
                and check.detail == "a side is not finite"
            )
    # NaN in both sides at the same place is not "equal".
    nan = torch.full((2,), math.nan)
    assert not compare("x == y", ["x"], nan, nan.clone(), rtol=1e-4).passed


@SETTINGS
@given(
    values=st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=12),
    shift=st.floats(-3.0, 3.0),
)
def test_compare_differs_passes_exactly_where_compare_fails(
    values: list[float], shift: float
) -> None:
    """An encoder's direction check: the change must reach the compared logits."""
    want = torch.tensor(values)
    got = want + shift
    same, differs = (
        compare("x", ["h"], got, want, rtol=1e-4),
        compare_differs("x", ["h"], got, want, rtol=1e-4),
    )
    assert differs.passed == (not same.passed)
    assert (differs.error, differs.allowed) == (same.error, same.allowed)
    if not differs.passed:
        assert "did not reach them" in differs.detail


def test_compare_differs_fails_on_a_missing_side_a_shape_mismatch_and_nothing_compared() -> None:
    x = torch.zeros(2, 3)
    assert not compare_differs("x", ["h"], None, x, rtol=1e-4).passed
    assert not compare_differs("x", ["h"], torch.ones(3, 2), x, rtol=1e-4).passed
    assert not compare_differs("x", ["h"], torch.zeros(0), torch.zeros(0), rtol=1e-4).passed
    assert not compare_differs("x", ["h"], x + math.inf, x, rtol=1e-4).passed


def test_compare_masks_and_accepts_an_empty_mask() -> None:
    want = torch.zeros(1, 4)
    got = torch.tensor([[0.0, 5.0, 0.0, 5.0]])
    keep = torch.tensor([[True, False, True, False]])
    assert compare("m", ["x"], got, want, rtol=1e-4, mask=keep).passed
    assert not compare("m", ["x"], got, want, rtol=1e-4, mask=~keep).passed
    # A mask over fewer axes broadcasts (a [q, k] mask over [b, h, q, k] scores).
    scores = torch.zeros(2, 3, 4, 4)
    other = scores.clone()
    other[..., 0, 3] = 7.0
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert compare("s", ["s"], other, scores, rtol=1e-4, mask=causal).passed
    empty = compare("m", ["x"], got, want, rtol=1e-4, mask=torch.zeros(1, 4, dtype=torch.bool))
    assert empty.passed and empty.error == 0.0 and empty.detail == "nothing to compare"


def test_check_line() -> None:
    ok = CertificationCheck("a == b", ("a",), True, 1e-6, 1e-4)
    bad = CertificationCheck("a == b", ("a",), False, math.inf, 0.0, "it never fired")
    assert ok.line() == "ok   a == b  [err 1.00e-06 <= 1.00e-04]"
    assert bad.line() == "FAIL a == b  [err inf <= 0.00e+00] (it never fired)"


# -- equation_checks on synthetic captures ------------------------------------------------

D_MODEL, N_HEADS, N_KV, D_HEAD, D_MLP = 8, 4, 2, 3, 6


def _info(
    form: Form, n_layers: int, norm: Literal["LN", "RMS"], gated: bool, rotary: bool
) -> ModelInfo:
    return ModelInfo(
        n_layers=n_layers, d_model=D_MODEL, n_heads=N_HEADS, d_head=D_HEAD, d_mlp=D_MLP, d_vocab=11,
        n_ctx=16, n_key_value_heads=N_KV, normalization_type=norm,
        positional_embedding_type="rotary" if rotary else "standard", gated_mlp=gated,
        parallel_attn_mlp=form == "parallel", sandwich_norm=form == "sandwich",
        post_residual_norm=form == "post_ln", act_fn="silu" if gated else "gelu",
    )  # fmt: skip


def _norm(
    cache: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, norm: str, gen: torch.Generator
) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True) if norm == "LN" else x
    scale = (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    normalized = centred / scale
    out = normalized * (1 + 0.1 * torch.randn(x.shape[-1], generator=gen, dtype=x.dtype))
    cache.update(
        {
            f"{prefix}.hook_in": x,
            f"{prefix}.hook_scale": scale,
            f"{prefix}.hook_normalized": normalized,
            f"{prefix}.hook_out": out,
        }
    )
    return out


def synthetic(
    info: ModelInfo, *, seed: int, pos: int = 5, softcap: float | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A capture of every hook that satisfies every equation of ``info``'s block form, and
    the keyword arguments of ``equation_checks`` that go with it (references, ``W_O``)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    n, norm = info.n_layers, str(info.normalization_type)
    W_O, b_O = rand(n, N_HEADS, D_HEAD, D_MODEL) / 3, rand(n, D_MODEL) / 10
    scale = float(0.2 + torch.rand(1, generator=gen))
    causal = torch.ones(pos, pos, dtype=torch.bool).tril()
    act = torch.nn.functional.silu if info.gated_mlp else torch.nn.functional.gelu
    cache: dict[str, torch.Tensor] = {}
    resid = rand(1, pos, D_MODEL)
    cache["embed.hook_out"] = resid
    for i in range(n):
        b = f"blocks.{i}."
        cache[b + "hook_in"] = resid
        # Post-LN (BERT): attention reads the block input; ln1 comes after its add.
        attn_in = resid if info.post_residual_norm else _norm(cache, b + "ln1", resid, norm, gen)
        cache[b + "attn.hook_in"] = attn_in
        q, k, v = (
            rand(1, pos, N_HEADS, D_HEAD),
            rand(1, pos, N_KV, D_HEAD),
            rand(1, pos, N_KV, D_HEAD),
        )
        rep = N_HEADS // N_KV
        dots = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, dim=2)) * scale
        scores = softcap * torch.tanh(dots / softcap) if softcap else dots
        scores = scores.masked_fill(~causal, -math.inf)
        pattern = torch.softmax(scores, dim=-1)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v.repeat_interleave(rep, dim=2))
        attn_out = torch.einsum("bqhd,hde->bqe", z, W_O[i]) + b_O[i]
        qn, kn = (
            ("hook_rot_q", "hook_rot_k")
            if info.positional_embedding_type == "rotary"
            else ("hook_q", "hook_k")
        )
        cache.update({
            b + f"attn.{qn}": q, b + f"attn.{kn}": k, b + "attn.hook_v": v, b + "attn.hook_attn_scores": scores,
            b + "attn.hook_pattern": pattern, b + "attn.hook_z": z, b + "attn.hook_out": attn_out,
        })  # fmt: skip
        if info.sandwich_norm:
            attn_out = _norm(cache, b + "ln1_post", attn_out, norm, gen)
        if info.post_residual_norm:
            mid = mlp_in = _norm(cache, b + "ln1", resid + attn_out, norm, gen)
        elif info.parallel_attn_mlp:
            mlp_in = _norm(cache, b + "ln2", resid, norm, gen)
        else:
            mid = resid + attn_out
            mlp_in = _norm(cache, b + "ln2", mid, norm, gen)
        pre = rand(1, pos, D_MLP)
        post = act(pre)
        if info.gated_mlp:
            cache[b + "mlp.hook_pre_linear"] = lin = rand(1, pos, D_MLP)
            post = post * lin
        mlp_out = rand(1, pos, D_MODEL)
        cache.update(
            {
                b + "mlp.hook_in": mlp_in,
                b + "mlp.hook_pre": pre,
                b + "mlp.hook_post": post,
                b + "mlp.hook_out": mlp_out,
            }
        )
        if info.sandwich_norm:
            mlp_out = _norm(cache, b + "ln2_post", mlp_out, norm, gen)
        if info.post_residual_norm:
            resid = _norm(cache, b + "ln2", mid + mlp_out, norm, gen)
        else:
            resid = (resid + attn_out + mlp_out) if info.parallel_attn_mlp else (mid + mlp_out)
        cache[b + "hook_out"] = resid
    _norm(cache, "ln_final", resid, norm, gen)
    logits = rand(1, pos, 11)
    hidden = [cache[f"blocks.{i}.hook_in"] for i in range(n)] + [cache["ln_final.hook_out"]]
    extras = {
        "hidden_states": hidden,
        "logits": logits,
        "reference_logits": logits.clone(),
        "W_O": W_O,
        "b_O": b_O,
        "attn_softcap": softcap,
    }
    # Captures are float32, as a driver's are.
    return {k: v.float() for k, v in cache.items()}, extras


forms = st.sampled_from(["sequential", "parallel", "sandwich", "post_ln"])
infos = st.builds(
    _info,
    form=forms,
    n_layers=st.integers(1, 3),
    norm=st.sampled_from(["LN", "RMS"]),
    gated=st.booleans(),
    rotary=st.booleans(),
)


@SETTINGS
@given(info=infos, seed=st.integers(0, 2**16), softcap=st.sampled_from([None, 5.0]))
def test_a_capture_that_satisfies_its_form_passes_every_equation(
    info: ModelInfo, seed: int, softcap: float | None
) -> None:
    cache, extras = synthetic(info, seed=seed, softcap=softcap)
    checks = equation_checks(cache, info, **extras)
    assert [c.line() for c in checks if not c.passed] == []
    equations = {c.equation for c in checks}
    n = info.n_layers
    assert "logits == the engine's own logits" in equations
    assert {f"blocks.{i}.hook_in == the engine's hidden_states[{i}]" for i in range(n)} <= equations
    assert f"blocks.{n - 1}.hook_out == ln_final.hook_in" in equations
    attn_out = "ln1_post.hook_out" if info.sandwich_norm else "attn.hook_out"
    mlp_out = "ln2_post.hook_out" if info.sandwich_norm else "mlp.hook_out"
    if info.post_residual_norm:
        assert {
            "blocks.0.attn.hook_in == blocks.0.hook_in",
            "blocks.0.ln1.hook_in == blocks.0.hook_in + blocks.0.attn.hook_out",
            "blocks.0.mlp.hook_in == blocks.0.ln1.hook_out",
            "blocks.0.ln2.hook_in == blocks.0.ln1.hook_out + blocks.0.mlp.hook_out",
            "blocks.0.hook_out == blocks.0.ln2.hook_out",
        } <= equations
    elif info.parallel_attn_mlp:
        assert (
            f"blocks.0.hook_out == blocks.0.hook_in + blocks.0.{attn_out} + blocks.0.{mlp_out}"
            in equations
        )
        assert not any(
            e.startswith("blocks.0.ln2.hook_in == blocks.0.hook_in +") for e in equations
        )
    else:
        assert f"blocks.0.ln2.hook_in == blocks.0.hook_in + blocks.0.{attn_out}" in equations
        assert f"blocks.0.hook_out == blocks.0.ln2.hook_in + blocks.0.{mlp_out}" in equations
    assert (
        "blocks.0.attn.hook_out == blocks.0.ln1_post.hook_in" in equations
    ) is info.sandwich_norm
    assert "blocks.0.attn.hook_out == blocks.0.attn.hook_z @ W_O + b_O" in equations
    gated = "blocks.0.mlp.hook_post == act(blocks.0.mlp.hook_pre) * blocks.0.mlp.hook_pre_linear"
    assert (gated in equations) is info.gated_mlp
    what = "hook_in - mean" if info.normalization_type == "LN" else "hook_in"
    assert (
        f"blocks.0.ln1.hook_normalized * blocks.0.ln1.hook_scale == blocks.0.ln1.{what}"
        in equations
    )


def _sublayer_outputs(info: ModelInfo) -> list[str]:
    return ["attn.hook_out", "mlp.hook_out"] + (
        ["ln1_post.hook_out", "ln2_post.hook_out"] if info.sandwich_norm else []
    )


@SETTINGS
@given(info=infos, seed=st.integers(0, 2**16), data=st.data())
def test_perturbing_one_sublayer_output_fails_exactly_the_equations_naming_it(
    info: ModelInfo, seed: int, data: st.DataObject
) -> None:
    cache, extras = synthetic(info, seed=seed)
    layer = data.draw(st.integers(0, info.n_layers - 1), label="layer")
    name = f"blocks.{layer}." + data.draw(st.sampled_from(_sublayer_outputs(info)), label="site")
    where = data.draw(st.tuples(st.integers(0, 4), st.integers(0, D_MODEL - 1)), label="where")
    bad = cache[name].clone()
    bad[0, where[0], where[1]] += 0.5
    cache[name] = bad
    checks = equation_checks(cache, info, **extras)
    failed = {c.equation for c in checks if not c.passed}
    naming = {c.equation for c in checks if name in c.equation.split()}
    assert naming, f"no equation names {name}"
    assert failed == naming


def test_a_hook_that_never_fired_fails_the_equations_that_need_it() -> None:
    info = _info("sequential", 2, "RMS", True, True)
    cache, extras = synthetic(info, seed=0)
    del (
        cache["blocks.1.attn.hook_z"],
        cache["blocks.0.mlp.hook_pre_linear"],
        cache["blocks.0.hook_out"],
    )
    failed = {c.equation: c for c in equation_checks(cache, info, **extras) if not c.passed}
    assert set(failed) == {
        "blocks.1.attn.hook_z == blocks.1.attn.hook_pattern @ blocks.1.attn.hook_v",
        "blocks.0.mlp.hook_post == act(blocks.0.mlp.hook_pre) * blocks.0.mlp.hook_pre_linear",
        "blocks.0.hook_out == blocks.1.hook_in",
        "blocks.0.hook_out == blocks.0.ln2.hook_in + blocks.0.mlp.hook_out",
    }
    assert all(c.detail == "a hook on one side never fired" for c in failed.values())


def test_a_hook_missing_from_the_drivers_own_forward_is_refused_by_name() -> None:
    info = _info("sequential", 2, "RMS", True, True)
    cache, _ = synthetic(info, seed=0)
    names = sorted(cache)
    silent = ["blocks.0.attn.hook_z", "blocks.1.hook_in"]
    fired = {name: value for name, value in cache.items() if name not in silent}
    checks = silent_hook_checks(names, fired)
    assert [c.hooks for c in checks] == [(name,) for name in silent]
    assert not any(c.passed for c in checks)
    assert checks[0].equation == "blocks.0.attn.hook_z fires in a forward"
    statuses = statuses_from_checks(names, checks, described=True, strict=True)
    assert {name for name in names if statuses[name].status != "real"} == set(silent)
    assert silent_hook_checks(names, cache) == []


def test_a_head_transform_reads_the_last_block_instead_of_the_final_norm() -> None:
    """A masked LM's head (dense, activation, then the final norm): the last block's output
    is the transform's input, and the final norm's input is no longer that output."""
    info = dataclasses.replace(_info("post_ln", 2, "LN", False, False), head_transform=True)
    cache, extras = synthetic(info, seed=1)
    cache["mlm_head.hook_in"] = cache["blocks.1.hook_out"].clone()
    cache["ln_final.hook_in"] = cache["ln_final.hook_in"] * 2.0  # what the transform hands on
    _norm(cache, "ln_final", cache["ln_final.hook_in"].double(), "LN", torch.Generator())
    cache = {k: v.float() for k, v in cache.items()}
    checks = {c.equation: c for c in equation_checks(cache, info, **extras)}
    assert checks["blocks.1.hook_out == mlm_head.hook_in"].passed
    assert "blocks.1.hook_out == ln_final.hook_in" not in checks
    cache["mlm_head.hook_in"] = cache["mlm_head.hook_in"] + 0.5
    checks = {c.equation: c for c in equation_checks(cache, info, **extras)}
    assert not checks["blocks.1.hook_out == mlm_head.hook_in"].passed


def test_a_mixer_block_adds_its_mixer_output_and_reads_its_norm() -> None:
    info = dataclasses.replace(_info("sequential", 2, "RMS", False, False), mixer=True)
    gen = torch.Generator().manual_seed(0)
    cache: dict[str, torch.Tensor] = {"blocks.0.hook_in": torch.randn(1, 5, D_MODEL, generator=gen)}
    for i in range(2):
        b = f"blocks.{i}."
        x = cache[b + "hook_in"]
        normed = _norm(cache, b + "ln1", x, "RMS", gen)
        cache[b + "mixer.hook_in"] = normed
        cache[b + "mixer.hook_out"] = torch.tanh(normed).cumsum(dim=1)  # mixes positions
        cache[b + "hook_out"] = x + cache[b + "mixer.hook_out"]
        if i == 0:
            cache["blocks.1.hook_in"] = cache[b + "hook_out"]
    checks = equation_checks(cache, info, rtol=1e-5)
    assert "blocks.1.hook_out == blocks.1.hook_in + blocks.1.mixer.hook_out" in {
        c.equation for c in checks
    }
    assert all(c.passed for c in checks), [c.line() for c in checks if not c.passed]
    cache["blocks.1.mixer.hook_out"] = cache["blocks.1.mixer.hook_out"] * 1.01
    failed = [c for c in equation_checks(cache, info, rtol=1e-5) if not c.passed]
    assert [c.equation for c in failed] == [
        "blocks.1.hook_out == blocks.1.hook_in + blocks.1.mixer.hook_out"
    ]
    assert failed[0].hooks == ("blocks.1.mixer.hook_out",)


def test_hidden_states_may_be_block_inputs_or_block_outputs_but_nothing_else() -> None:
    info = _info("sequential", 3, "RMS", True, True)
    cache, extras = synthetic(info, seed=1)
    inputs = extras["hidden_states"]  # [in 0, in 1, in 2, final norm's output]
    # Block inputs (transformers' usual convention): vouch for blocks.i.hook_in.
    passed = [c for c in equation_checks(cache, info, **extras) if "hidden_states" in c.equation]
    assert [(c.equation, c.passed) for c in passed] == [
        (f"blocks.{i}.hook_in == the engine's hidden_states[{i}]", True) for i in range(3)
    ]
    # Block outputs (Mamba's): vouch for blocks.i.hook_out instead.
    outputs = equation_checks(cache, info, **{**extras, "hidden_states": inputs[1:]})
    assert [(c.equation, c.passed) for c in outputs if "hidden_states" in c.equation] == [
        (f"blocks.{i}.hook_out == the engine's hidden_states[{i}] (it reports block outputs)", True)
        for i in range(2)
    ]
    # Neither (a residual stream off by two blocks, or not this model's): the block-input
    # equations fail, and the logits reference catches a wrong run.
    wrong = {
        **extras,
        "hidden_states": [*inputs[2:], inputs[0], inputs[0]],
        "reference_logits": extras["logits"] + 1.0,
    }
    failed = [c.equation for c in equation_checks(cache, info, **wrong) if not c.passed]
    assert failed == [
        "logits == the engine's own logits",
        "blocks.0.hook_in == the engine's hidden_states[0]",
        "blocks.1.hook_in == the engine's hidden_states[1]",
        "blocks.2.hook_in == the engine's hidden_states[2]",
    ]


def test_attention_equations_see_heads_mixed_up() -> None:
    info = _info("sequential", 1, "RMS", False, True)
    cache, extras = synthetic(info, seed=2)
    k = cache["blocks.0.attn.hook_rot_k"]
    cache["blocks.0.attn.hook_rot_k"] = k.flip(2)  # kv heads swapped: scores no longer q . k
    v = cache["blocks.0.attn.hook_v"]
    cache["blocks.0.attn.hook_v"] = v.flip(2)
    failed = [c.equation for c in equation_checks(cache, info, **extras) if not c.passed]
    assert len(failed) == 2
    assert failed[0] == "blocks.0.attn.hook_z == blocks.0.attn.hook_pattern @ blocks.0.attn.hook_v"
    assert failed[1].startswith(
        "blocks.0.attn.hook_attn_scores == blocks.0.attn.hook_rot_q . blocks.0.attn.hook_rot_k * scale"
    )


def test_a_pattern_that_is_not_a_distribution_fails() -> None:
    info = _info("sequential", 1, "LN", False, False)
    cache, extras = synthetic(info, seed=3)
    cache["blocks.0.attn.hook_pattern"] = cache["blocks.0.attn.hook_pattern"] * 1.01
    failed = [c.equation for c in equation_checks(cache, info, **extras) if not c.passed]
    assert "blocks.0.attn.hook_pattern sums to 1 over keys" in failed


def test_equation_checks_skip_what_the_capture_does_not_cover() -> None:
    info = _info("sequential", 2, "RMS", True, True)
    cache = {"blocks.0.hook_in": torch.ones(1, 2, D_MODEL)}
    checks = equation_checks(cache, info)
    # No references, no W_O, no attention or MLP sites: only the chain and block equations,
    # which fail because the other side never fired.
    assert all(not c.passed for c in checks)
    assert not any(
        "attn.hook_z" in c.equation
        or "hidden_states" in c.equation
        or c.equation.startswith("logits")
        for c in checks
    )


# -- statuses_from_checks -----------------------------------------------------------------


def _check(
    equation: str, hooks: tuple[str, ...], passed: bool, detail: str = ""
) -> CertificationCheck:
    return CertificationCheck(equation, hooks, passed, 0.0 if passed else 1.0, 1e-4, detail)


NAMES = [
    "embed.hook_out",
    "blocks.0.hook_in",
    "blocks.0.attn.hook_out",
    "blocks.0.mlp.hook_pre",
    "unembed.hook_out",
]


@pytest.mark.parametrize("described", [True, False])
def test_statuses_default_by_whether_the_family_is_described(described: bool) -> None:
    checks = [_check("blocks.0.hook_in == h[0]", ("blocks.0.hook_in",), True)]
    statuses = statuses_from_checks(NAMES, checks, described=described)
    assert list(statuses) == NAMES
    assert statuses["blocks.0.hook_in"] == HookCertificate("real", "checked by an equation")
    unchecked = statuses["blocks.0.attn.hook_out"]
    if described:
        assert unchecked == HookCertificate(
            "real", "described by hand; checked by the family's parity test"
        )
    else:
        assert unchecked == HookCertificate(
            "uncertified", "no equation checks it on an inferred architecture"
        )


def test_a_failed_check_wins_over_passed_ones_and_absent_wins_over_both() -> None:
    checks = [
        _check("a passes", ("blocks.0.attn.hook_out", "blocks.0.mlp.hook_pre"), True),
        _check("first failure", ("blocks.0.attn.hook_out",), False, "it never fired"),
        _check("second failure", ("blocks.0.attn.hook_out", "unembed.hook_out"), False),
        _check("absent but checked", ("blocks.0.mlp.hook_pre",), False),
    ]
    statuses = statuses_from_checks(
        NAMES, checks, described=True, absent={"blocks.0.mlp.hook_pre": "a mixture of experts"},
        read_only={"embed.hook_out": "fused kernel"},
    )  # fmt: skip
    assert statuses["blocks.0.attn.hook_out"] == HookCertificate(
        "uncertified", "failed: first failure (it never fired)"
    )
    assert statuses["unembed.hook_out"] == HookCertificate("uncertified", "failed: second failure")
    assert statuses["blocks.0.mlp.hook_pre"] == HookCertificate(
        "structurally_absent", "a mixture of experts"
    )
    # read_only notes a hook only once an equation passed for it.
    assert (
        statuses["embed.hook_out"].reason
        == "described by hand; checked by the family's parity test"
    )
    with_note = statuses_from_checks(
        ["embed.hook_out"],
        [_check("e", ("embed.hook_out",), True)],
        described=False,
        read_only={"embed.hook_out": "fused kernel"},
    )
    assert with_note["embed.hook_out"] == HookCertificate("real", "read-only: fused kernel")


def test_strict_statuses_withdraw_what_only_tainted_equations_vouch_for() -> None:
    # Attention and MLP swapped: the block equation still holds, the residual between them
    # does not; strictly, the MLP output the block equation alone vouched for is withdrawn,
    # and the block output (vouched for by the residual chain too) stays.
    b = "blocks.0."
    checks = [
        _check(
            "block", (b + "hook_in", b + "attn.hook_out", b + "mlp.hook_out", b + "hook_out"), True
        ),
        _check("mid", (b + "hook_in", b + "attn.hook_out", b + "ln2.hook_in"), False),
        _check("chain", (b + "hook_out", "blocks.1.hook_in"), True),
    ]
    names = [
        b + "hook_in",
        b + "attn.hook_out",
        b + "ln2.hook_in",
        b + "mlp.hook_out",
        b + "hook_out",
        "blocks.1.hook_in",
    ]
    loose = statuses_from_checks(names, checks, described=True)
    assert loose[b + "mlp.hook_out"].status == "real"
    strict = statuses_from_checks(names, checks, described=True, strict=True)
    assert strict[b + "mlp.hook_out"] == HookCertificate(
        "uncertified", f"failed: every equation over it also covers {b}hook_in, which failed"
    )
    assert strict[b + "hook_out"].status == "real" and strict["blocks.1.hook_in"].status == "real"


@SETTINGS
@given(
    verdicts=st.lists(st.tuples(st.sampled_from(NAMES), st.booleans()), max_size=12),
    described=st.booleans(),
)
def test_a_hook_is_served_only_when_no_check_covering_it_failed(
    verdicts: list[tuple[str, bool]], described: bool
) -> None:
    checks = [_check(f"eq{i}", (name,), passed) for i, (name, passed) in enumerate(verdicts)]
    statuses = statuses_from_checks(NAMES, checks, described=described)
    for name in NAMES:
        mine = [passed for hook, passed in verdicts if hook == name]
        served = statuses[name].status == "real"
        assert served is (all(mine) and (bool(mine) or described))
        if not all(mine):
            first = next(
                i for i, (hook, passed) in enumerate(verdicts) if hook == name and not passed
            )
            assert statuses[name].reason == f"failed: eq{first}"


# -- the report ---------------------------------------------------------------------------


def _report(inferred: bool) -> Certification:
    checks = (
        _check("blocks.0.hook_in == the engine's hidden_states[0]", ("blocks.0.hook_in",), True),
        _check(
            "blocks.0.ln2.hook_in == blocks.0.hook_in + blocks.0.attn.hook_out",
            ("blocks.0.attn.hook_out",),
            False,
        ),
        _check(
            "blocks.1.ln2.hook_in == blocks.1.hook_in + blocks.1.attn.hook_out",
            ("blocks.1.attn.hook_out",),
            False,
        ),
    )
    names = [
        "blocks.0.hook_in",
        "blocks.1.hook_in",
        "blocks.0.attn.hook_out",
        "blocks.1.attn.hook_out",
        "blocks.0.mlp.hook_pre",
    ]
    statuses = statuses_from_checks(
        names, checks, described=not inferred, absent={"blocks.0.mlp.hook_pre": "experts"}
    )
    return Certification(
        model="tiny", driver="hf", family="inferred" if inferred else "llama", inferred=inferred, level="residual",
        description={"layers": "model.layers (2 x Layer)"}, checks=checks, statuses=statuses,
    )  # fmt: skip


@pytest.mark.parametrize("inferred", [True, False])
def test_the_report_names_failed_checks_and_statuses(inferred: bool) -> None:
    report = _report(inferred)
    text = report.format()
    assert str(report) == text
    lines = text.splitlines()
    assert lines[0] == "certification of tiny on the hf driver"
    how = "inferred from the module tree" if inferred else "described (llama)"
    assert lines[1] == f"architecture: {how}; served at level 'residual'"
    assert "  layers: model.layers (2 x Layer)" in lines
    assert "checks: 1 of 3 passed" in lines
    assert (
        "  FAIL blocks.0.ln2.hook_in == blocks.0.hook_in + blocks.0.attn.hook_out  [err 1.00e+00 <= 1.00e-04]"
        in lines
    )
    assert not any(line.strip().startswith("ok") for line in lines), (
        "passed checks only with verbose"
    )
    assert f"  uncertified: {3 if inferred else 2}" in lines
    # Templates, with the reason of the template's first name (in forward order).
    assert (
        "    blocks.{i}.attn.hook_out  (failed: blocks.0.ln2.hook_in == blocks.0.hook_in + blocks.0.attn.hook_out)"
        in lines
    )
    assert "  structurally_absent: 1" in lines and "    blocks.{i}.mlp.hook_pre  (experts)" in lines
    assert f"  real: {1 if inferred else 2}" in lines and "    blocks.{i}.hook_in" in lines
    assert "  derived" not in text, "empty statuses are left out"
    if inferred:
        assert (
            "    blocks.{i}.hook_in  (no equation checks it on an inferred architecture)" in lines
        )
        assert report.served == ("blocks.0.hook_in",)
    else:
        assert report.served == ("blocks.0.hook_in", "blocks.1.hook_in")


def test_the_verbose_report_lists_every_check_and_name() -> None:
    report = _report(inferred=False)
    lines = report.format(verbose=True).splitlines()
    assert (
        "  ok   blocks.0.hook_in == the engine's hidden_states[0]  [err 0.00e+00 <= 1.00e-04]"
        in lines
    )
    assert (
        "    blocks.0.attn.hook_out  (failed: blocks.0.ln2.hook_in == blocks.0.hook_in + blocks.0.attn.hook_out)"
        in lines
    )
    assert (
        "    blocks.1.attn.hook_out  (failed: blocks.1.ln2.hook_in == blocks.1.hook_in + blocks.1.attn.hook_out)"
        in lines
    )


def test_report_groups() -> None:
    report = _report(inferred=True)
    groups = report.by_status()
    assert tuple(groups) == CERTIFIED_STATUSES
    assert groups["uncertified"] == [
        "blocks.1.hook_in",
        "blocks.0.attn.hook_out",
        "blocks.1.attn.hook_out",
    ]
    assert groups["derived"] == [] and groups["reconstructed_read_only"] == []
    assert [c.equation for c in report.failed] == [c.equation for c in report.checks[1:]]


def _rotation_checks(
    rq: torch.Tensor,
    rk: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
) -> list[CertificationCheck]:
    info = _info("sequential", 1, "RMS", True, True)
    a = "blocks.0.attn."
    cache = {a + "hook_q": q, a + "hook_k": k, a + "hook_rot_q": rq, a + "hook_rot_k": rk}
    if cos is not None and sin is not None:  # a driver that serves the rotary table
        cache.update({a + "hook_cos": cos, a + "hook_sin": sin})
    cache[a + "hook_v"] = torch.zeros_like(k)  # attention's checks run where its sites fired
    return [
        c
        for c in equation_checks(cache, info)
        if "rotated by" in c.equation or "rotation keeps" in c.equation
    ]


def test_a_table_with_one_entry_per_rotated_pair_certifies_on_halves() -> None:
    """gpt-oss rotates the two halves of each head by a table half the head wide (one entry
    per pair); the rotary equation finds that layout, and fails a rotation turned the
    wrong way."""
    gen = torch.Generator().manual_seed(5)
    d_head = 8
    q, k = (
        torch.randn(1, 3, N_HEADS, d_head, generator=gen),
        torch.randn(1, 3, N_KV, d_head, generator=gen),
    )
    angles = torch.rand(1, 3, d_head // 2, generator=gen) * 3
    cos, sin = angles.cos() * 1.3, angles.sin() * 1.3  # YaRN scales the table

    def gpt_oss(x: torch.Tensor, sign: float) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        c, s = cos[:, :, None], sign * sin[:, :, None]
        return torch.cat((first * c - second * s, second * c + first * s), dim=-1)

    checks = _rotation_checks(gpt_oss(q, 1.0), gpt_oss(k, 1.0), q, k, cos, sin)
    assert [c.passed for c in checks] == [True]
    assert checks[0].equation.endswith("(halves, one entry per pair)")
    wrong = _rotation_checks(gpt_oss(q, -1.0), gpt_oss(k, -1.0), q, k, cos, sin)
    assert [c.passed for c in wrong] == [False]


def test_the_mlp_output_is_the_routed_experts_plus_the_gated_shared_expert() -> None:
    info = dataclasses.replace(
        _info("sequential", 1, "RMS", True, True),
        n_experts=4,
        experts_per_token=2,
        d_shared_expert=6,
    )
    gen = torch.Generator().manual_seed(9)
    m = "blocks.0.mlp."
    pre, lin = torch.randn(1, 3, 6, generator=gen), torch.randn(1, 3, 6, generator=gen)
    routed, shared = (
        torch.randn(1, 3, D_MODEL, generator=gen),
        torch.randn(1, 3, D_MODEL, generator=gen),
    )
    gate = torch.randn(1, 3, 1, generator=gen)
    cache = {
        m + "shared_expert.hook_pre": pre,
        m + "shared_expert.hook_pre_linear": lin,
        m + "shared_expert.hook_post": torch.nn.functional.silu(pre) * lin,
        m + "experts.hook_out": routed,
        m + "shared_expert.hook_out": shared,
        m + "shared_expert.hook_gate": gate,
        m + "hook_out": routed + torch.sigmoid(gate) * shared,
    }

    def shared_checks(c: dict[str, torch.Tensor]) -> list[CertificationCheck]:
        return [x for x in equation_checks(c, info) if "shared_expert" in x.equation]

    assert [x.passed for x in shared_checks(cache)] == [True, True]
    ungated = {**cache, m + "hook_out": routed + shared}  # the gate left out
    assert [x.passed for x in shared_checks(ungated)] == [True, False]
    assert shared_checks(ungated)[1].equation == (
        "blocks.0.mlp.hook_out == blocks.0.mlp.experts.hook_out + sigmoid(blocks.0.mlp.shared_expert.hook_gate) "
        "* blocks.0.mlp.shared_expert.hook_out"
    )


def test_without_a_served_table_a_rotation_scaled_by_one_factor_keeps_lengths_up_to_it() -> None:
    """vLLM serves no rotary table; YaRN (gpt-oss) scales every rotated head by one factor.
    One factor for every head and position passes; a factor per head does not."""
    gen = torch.Generator().manual_seed(6)
    d_head = 8
    q, k = (
        torch.randn(1, 4, N_HEADS, d_head, generator=gen),
        torch.randn(1, 4, N_KV, d_head, generator=gen),
    )
    angles = torch.rand(1, 4, d_head // 2, generator=gen) * 3
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * cos[:, :, None] + torch.cat((-second, first), -1) * sin[:, :, None]

    scaled = _rotation_checks(1.35 * rotate(q), 1.35 * rotate(k), q, k, None, None)
    assert [c.passed for c in scaled] == [True]
    assert "one factor, 1.35" in scaled[0].equation
    per_head = torch.linspace(1.0, 1.5, N_HEADS)[None, None, :, None]
    uneven = _rotation_checks(per_head * rotate(q), rotate(k), q, k, None, None)
    assert [c.passed for c in uneven] == [False]
