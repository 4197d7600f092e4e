"""Diagnostics that name the cause of a FAIL, proved by drivers that are wrong on purpose.

The unit tests build a reference from synthetic tensors with the structure of a real
forward pass (torch only). The fault tests boot the ``tl-parity-faults`` fixture drivers
(hf underneath, one deliberately wrong capture each) through their entry points; they
need ``tl-driver-hf`` and the fixture installed
(``pip install -e packages/tl-parity/tests/fixtures/tl-parity-faults``), as the nox
session does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tl_core.hooks import ModelInfo
from tl_parity._diagnose import diagnose

B, P, D, H, DH = 2, 7, 16, 4, 4
INFO = ModelInfo(n_layers=3, d_model=D, n_heads=H, d_head=DH, d_mlp=32, d_vocab=50, n_ctx=64)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


@pytest.fixture
def ref() -> dict[str, torch.Tensor]:
    """A reference cache of three blocks whose sites relate as in a real forward pass."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    out: dict[str, torch.Tensor] = {"embed.hook_in": torch.randint(0, 50, (B, P), generator=g)}
    resid = rand(B, P, D) * math.sqrt(D)
    out["embed.hook_out"] = resid
    for i in range(3):
        out[f"blocks.{i}.hook_in"] = resid
        out[f"blocks.{i}.ln1.hook_in"] = resid
        normed = _rms(resid)
        w = 1 + 0.3 * rand(D)
        out[f"blocks.{i}.ln1.hook_normalized"] = normed
        out[f"blocks.{i}.ln1.hook_out"] = normed * w
        out[f"blocks.{i}.attn.hook_z"] = rand(B, P, H, DH)
        out[f"blocks.{i}.attn.hook_pattern"] = torch.softmax(rand(B, H, P, P), -1)
        attn = rand(B, P, D)
        mlp = rand(B, P, D)
        out[f"blocks.{i}.attn.hook_out"] = attn
        out[f"blocks.{i}.mlp.hook_out"] = mlp
        resid = resid + attn + mlp
        out[f"blocks.{i}.hook_out"] = resid
    out["ln_final.hook_in"] = resid
    out["ln_final.hook_normalized"] = _rms(resid)
    out["ln_final.hook_out"] = _rms(resid) * (1 + 0.3 * rand(D)) + 0.2 * rand(D)
    return out


# -- another site -------------------------------------------------------------------------


def test_sublayer_output_under_another_sublayers_name(ref: dict[str, torch.Tensor]) -> None:
    msg = diagnose("blocks.1.attn.hook_out", ref["blocks.1.mlp.hook_out"], ref, INFO)
    assert msg is not None
    assert "serves blocks.1.mlp.hook_out" in msg and "another sublayer's name" in msg


@pytest.mark.parametrize(
    ("hook", "served", "expected"),
    [
        (
            "blocks.0.hook_out",
            "blocks.1.hook_out",
            "off by one layer: serves blocks.1.hook_out (one block later)",
        ),
        (
            "blocks.2.hook_out",
            "blocks.1.hook_out",
            "off by one layer: serves blocks.1.hook_out (one block earlier)",
        ),
        (
            "blocks.0.attn.hook_out",
            "blocks.2.attn.hook_out",
            "off by 2 layers: serves blocks.2.attn.hook_out",
        ),
    ],
)
def test_off_by_layers(ref: dict[str, torch.Tensor], hook: str, served: str, expected: str) -> None:
    msg = diagnose(hook, ref[served], ref, INFO)
    assert msg is not None and msg.startswith(expected), msg


def test_same_layer_suffix_wins_and_aliases_are_listed(ref: dict[str, torch.Tensor]) -> None:
    # blocks.0.hook_out is also blocks.1.hook_in and blocks.1.ln1.hook_in: the off-by-one
    # reading is the specific one, the identical sites are listed after it.
    msg = diagnose("blocks.1.hook_out", ref["blocks.0.hook_out"], ref, INFO)
    assert msg is not None and msg.startswith("off by one layer: serves blocks.0.hook_out"), msg
    assert "the reference holds the same tensor at blocks.1.hook_in" in msg


def test_input_served_as_output(ref: dict[str, torch.Tensor]) -> None:
    msg = diagnose("ln_final.hook_out", ref["ln_final.hook_normalized"], ref, INFO)
    assert msg is not None and "pre-weight" in msg and "serves ln_final.hook_normalized" in msg


@pytest.mark.parametrize("norm", ["blocks.2.ln1", "ln_final"])
def test_post_weight_served_as_normalized(ref: dict[str, torch.Tensor], norm: str) -> None:
    msg = diagnose(f"{norm}.hook_normalized", ref[f"{norm}.hook_out"], ref, INFO)
    assert msg is not None
    assert f"serves {norm}.hook_out" in msg and "post-weight" in msg


@pytest.mark.parametrize(("norm", "bias"), [("blocks.2.ln1", False), ("ln_final", True)])
def test_per_channel_weight_found_without_the_other_site(
    ref: dict[str, torch.Tensor], norm: str, bias: bool
) -> None:
    post = ref.pop(f"{norm}.hook_out")
    msg = diagnose(f"{norm}.hook_normalized", post, ref, INFO)
    assert msg is not None and "per-channel weight" in msg and "post-weight" in msg, msg
    assert ("and bias" in msg) is bias


def test_per_channel_weight_missing_from_hook_out(ref: dict[str, torch.Tensor]) -> None:
    pre = ref.pop("blocks.0.ln1.hook_normalized")
    msg = diagnose("blocks.0.ln1.hook_out", pre, ref, INFO)
    assert msg is not None and "weight is missing" in msg and "pre-weight" in msg, msg


# -- scales -------------------------------------------------------------------------------


def test_unscaled_embedding(ref: dict[str, torch.Tensor]) -> None:
    msg = diagnose("embed.hook_out", ref["embed.hook_out"] / math.sqrt(D), ref, INFO)
    assert msg is not None
    assert "1/sqrt(d_model)" in msg and "sqrt(d_model) scale is missing" in msg, msg


def test_sqrt_d_model_recognised_without_model_info(ref: dict[str, torch.Tensor]) -> None:
    msg = diagnose("blocks.0.mlp.hook_out", ref["blocks.0.mlp.hook_out"] * math.sqrt(D), ref, None)
    assert msg is not None and f"= sqrt(d_model) (d_model={D})" in msg, msg


@pytest.mark.parametrize(("factor", "text"), [(2.5, "c = 2.5"), (-1.0, "sign flip")])
def test_other_constant_scales(ref: dict[str, torch.Tensor], factor: float, text: str) -> None:
    msg = diagnose("blocks.1.attn.hook_out", ref["blocks.1.attn.hook_out"] * factor, ref, INFO)
    assert msg is not None and text in msg, msg


# -- layouts ------------------------------------------------------------------------------


def test_heads_and_positions_transposed(ref: dict[str, torch.Tensor]) -> None:
    z = ref["blocks.1.attn.hook_z"]
    msg = diagnose("blocks.1.attn.hook_z", z.transpose(1, 2), ref, INFO)
    assert (
        msg
        == "holds the reference with its axes as 'b h p dh' where 'b p h dh' is expected (a transposed layout)"
    )


def test_heads_and_head_width_reshaped(ref: dict[str, torch.Tensor]) -> None:
    z = ref["blocks.0.attn.hook_z"]
    wrong = z.transpose(2, 3).reshape(B, P, H, DH)  # same shape, (dh, h) memory read as (h, dh)
    msg = diagnose("blocks.0.attn.hook_z", wrong, ref, INFO)
    assert msg is not None and "'b p dh h'" in msg, msg


def test_query_and_key_transposed(ref: dict[str, torch.Tensor]) -> None:
    pattern = ref["blocks.2.attn.hook_pattern"]
    msg = diagnose("blocks.2.attn.hook_pattern", pattern.transpose(-1, -2), ref, INFO)
    assert msg is not None and "'b h k q' where 'b h q k'" in msg, msg


# -- no false diagnosis ---------------------------------------------------------------------


def test_correct_tensor_is_not_diagnosed(ref: dict[str, torch.Tensor]) -> None:
    for hook in (
        "blocks.1.hook_out",
        "ln_final.hook_normalized",
        "blocks.0.attn.hook_z",
        "embed.hook_out",
    ):
        assert diagnose(hook, ref[hook].clone(), ref, INFO) is None


def test_noisy_or_unrelated_tensor_is_not_diagnosed(ref: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(1)
    for hook in ("blocks.1.attn.hook_out", "ln_final.hook_normalized", "blocks.0.attn.hook_z"):
        noisy = ref[hook] + 0.05 * torch.randn(ref[hook].shape, generator=g)
        assert diagnose(hook, noisy, ref, INFO) is None
        assert diagnose(hook, torch.randn(ref[hook].shape, generator=g), ref, INFO) is None
    assert diagnose("embed.hook_in", ref["embed.hook_in"] + 1, ref, INFO) is None  # integer ids


def test_within_tolerance_still_matches(ref: dict[str, torch.Tensor]) -> None:
    near = ref["blocks.1.mlp.hook_out"] * (1 + 1e-4)
    msg = diagnose("blocks.1.attn.hook_out", near, ref, INFO)
    assert msg is not None and "serves blocks.1.mlp.hook_out" in msg


def test_non_finite_values_are_named(ref: dict[str, torch.Tensor]) -> None:
    bad = ref["blocks.0.hook_out"].clone()
    bad[0, 0, :3] = float("nan")
    msg = diagnose("blocks.0.hook_out", bad, ref, INFO)
    assert msg is not None and "3 non-finite" in msg


def test_transposed_layout_found_with_padding(ref: dict[str, torch.Tensor]) -> None:
    z = ref["blocks.1.attn.hook_z"].transpose(1, 2).clone()
    z[1, :, 5:] = -7.0  # padding of the second prompt, in the candidate's own layout
    msg = diagnose("blocks.1.attn.hook_z", z, ref, INFO, lengths=[P, 5])
    assert msg is not None and "'b h p dh'" in msg, msg


def test_padding_positions_are_ignored_with_lengths(ref: dict[str, torch.Tensor]) -> None:
    served = ref["blocks.1.mlp.hook_out"].clone()
    served[1, 4:] = 100.0  # an engine's padding: anything at all
    assert diagnose("blocks.1.attn.hook_out", served, ref, INFO) is None
    msg = diagnose("blocks.1.attn.hook_out", served, ref, INFO, lengths=[P, 4])
    assert msg is not None and "serves blocks.1.mlp.hook_out" in msg


# -- fault-injection drivers, end to end ------------------------------------------------------

#: driver, tiny family, the hooks it gets wrong, what the diagnostic of each must say.
FAULTS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "fault-mlp-as-attn": (
        "llama",
        {"blocks.1.attn.hook_out": ("serves blocks.1.mlp.hook_out", "another sublayer's name")},
    ),
    "fault-postweight-normalized": (
        "llama",
        {"ln_final.hook_normalized": ("serves ln_final.hook_out", "post-weight")},
    ),
    "fault-off-by-one": (
        "llama",
        {"blocks.0.hook_out": ("off by one layer", "serves blocks.1.hook_out")},
    ),
    "fault-unscaled-embed": (
        "gemma",
        {"embed.hook_out": ("1/sqrt(d_model)", "sqrt(d_model) scale is missing")},
    ),
}


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """Tiny checkpoints by family, written on first use; skips without the fixture drivers."""
    pytest.importorskip("tl_driver_hf", reason="the fault drivers wrap the hf driver")
    pytest.importorskip(
        "tl_parity_faults",
        reason="pip install -e packages/tl-parity/tests/fixtures/tl-parity-faults (nox does)",
    )
    from tl_driver_hf.testing import write_tiny_checkpoint

    patch = pytest.MonkeyPatch()
    patch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend
    root = tmp_path_factory.mktemp("faults")
    folders: dict[str, Path] = {}

    def folder(family: str) -> Path:
        if family not in folders:
            folders[family] = write_tiny_checkpoint(family, root / family)
        return folders[family]

    yield folder
    torch.set_num_threads(threads)
    patch.undo()


def _run(folder: Path, driver: str, ids: list[list[int]] | None = None) -> tuple[Any, Any]:
    import tl_core

    bridge = tl_core.boot(str(folder), driver=driver)
    try:
        d = bridge.driver
        if ids is None:
            ids = [
                d.tokenizer.encode("The quick brown fox jumps over"),
                d.tokenizer.encode("Hello there"),
            ]
        names = [n for n in d.namespace.ordered if n in d.namespace.served]
        result = d.forward(ids, capture=names, max_new_tokens=0)
        return (ids, d.namespace, d.info), result
    finally:
        bridge.close()


@pytest.mark.parametrize("driver", list(FAULTS))
def test_fault_driver_fails_the_right_hook_with_the_right_cause(
    fault_env: Callable[[str], Path], driver: str
) -> None:
    from tl_parity._compare import compare
    from tl_parity._tolerance import band_for

    family, wrong = FAULTS[driver]
    folder = fault_env(family)
    (ids, namespace, info), ref = _run(folder, "hf")
    _, cand = _run(folder, driver, ids)
    band = band_for("float32", "hf", driver)
    failed = {}
    for name, tensor in cand.captured.items():
        row = compare(
            name,
            tensor,
            ref.captured[name],
            layout=namespace.layout(name),
            lengths=ref.lengths,
            band=band,
        )
        if row.status != "PASS":
            failed[name] = diagnose(name, tensor, ref.captured, info, lengths=ref.lengths)
    assert set(failed) == set(wrong), failed
    for hook, phrases in wrong.items():
        msg = failed[hook]
        assert msg is not None and all(p in msg for p in phrases), (hook, msg)
    assert torch.equal(cand.logits, ref.logits)  # only the capture is faulted


def test_run_parity_reports_and_diagnoses_a_fault(fault_env: Callable[[str], Path]) -> None:
    from tl_parity import run_parity

    report = run_parity(
        str(fault_env("llama")), candidate="fault-mlp-as-attn", prompts=["Hello world", "A"]
    )
    assert report.error is None, report.error
    failures = {row.hook: row for row in report.failures}
    assert set(failures) == {"blocks.1.attn.hook_out"}
    row = failures["blocks.1.attn.hook_out"]
    assert row.status == "FAIL" and row.max_abs > row.atol
    assert row.diagnostic is not None and "serves blocks.1.mlp.hook_out" in row.diagnostic
