"""Bad requests fail before generation, with a message, and write no files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _tli_tasks import make_task
from inspect_ai import eval as inspect_eval
from inspect_ai.solver import generate

from tl_core import HookNameError, SpecError, UserError
from tl_driver_inspect import capture_activations, intervene


def run(task: Any, model: str, tmp_path: Path, **kw: Any) -> Any:
    return inspect_eval(
        task, model=model, max_connections=4, max_tokens=4, log_dir=str(tmp_path / "logs"),
        display="none", **kw,
    )[0]  # fmt: skip


def test_unknown_hook_suggests_names(tmp_path: Path) -> None:
    with pytest.raises(HookNameError, match="hook_resid_post"):
        capture_activations("blocks.1.hook_resid_pots", output_dir=str(tmp_path / "a"))


def test_bad_spec_fails_at_construction() -> None:
    with pytest.raises(SpecError, match=r"blocks\.1\.hook_out"):
        intervene({"blocks.1.hook_out": {"op": "scale", "factr": 2}})
    with pytest.raises(SpecError, match="mapping"):
        intervene([{"op": "suppress"}])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reduce": "median"}, "reduce must be"),
        ({"positions": "all"}, "positions must be"),
        ({"hooks": []}, "hooks is empty"),
    ],
)
def test_bad_options(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    args = {"hooks": "blocks.0.hook_out", "output_dir": str(tmp_path / "a"), **kwargs}
    with pytest.raises(UserError, match=match):
        capture_activations(**args)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only folders")
def test_unwritable_folder(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(UserError, match="not a writable folder"):
        capture_activations("blocks.0.hook_out", output_dir=str(locked / "acts"))


def test_output_dir_that_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="not a writable folder"):
        capture_activations("blocks.0.hook_out", output_dir=str(blocker))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("solvers", "match", "options"),
    [
        (
            lambda out: [capture_activations("blocks.7.hook_out", output_dir=out)],
            "blocks.7.hook_out",
            {},
        ),
        (
            lambda out: [
                intervene({"blocks.0.hook_out": {"op": "add", "value": [1.0, 2.0]}}),
                capture_activations("blocks.0.hook_out", output_dir=out),
            ],
            "width",
            {},
        ),
        (
            lambda out: [capture_activations("blocks.0.hook_out", output_dir=out)],
            "response cache",
            {"cache": True},
        ),
        (
            lambda out: [
                intervene({"blocks.0.hook_out": {"op": "suppress"}}),
                generate(cache=True),
            ],
            "response cache",
            {},
        ),
        (
            lambda out: [
                intervene({"blocks.0.hook_out": {"op": "add", "value": 1.0, "pos": 99}}),
                capture_activations("blocks.0.hook_out", output_dir=out),
            ],
            "pos",
            {},
        ),
    ],
    ids=["hook-not-on-model", "spec-width", "cache-capture", "cache-intervene", "pos-out-of-range"],
)
def test_model_dependent_errors_abort_the_eval(
    checkpoint: Path,
    provider: str,
    tmp_path: Path,
    solvers: Any,
    match: str,
    options: dict[str, Any],
) -> None:
    out = tmp_path / "acts"
    log = run(make_task(solvers(str(out)), n=4), f"{provider}/{checkpoint}", tmp_path, **options)
    assert log.status == "error"
    assert match in log.error.message
    assert not any(out.iterdir()) if out.exists() else True


@pytest.mark.slow
def test_non_tl_model(tmp_path: Path) -> None:
    out = tmp_path / "acts"
    log = run(
        make_task([capture_activations("blocks.0.hook_out", output_dir=str(out))], n=2),
        "mockllm/model",
        tmp_path,
    )
    assert log.status == "error" and "needs a tl model provider" in log.error.message
    assert not any(out.iterdir())


def test_vllm_provider_without_driver(tmp_path: Path) -> None:
    pytest.importorskip("inspect_ai")
    try:
        import tl_driver_vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tl-driver-vllm is installed here; the missing-driver message needs it absent")
    from inspect_ai.model import get_model

    with pytest.raises(Exception, match="pip install tl-driver-vllm"):
        get_model(f"tl_vllm/{tmp_path}")


def test_positions_resolve_against_the_prompt_or_fail() -> None:
    from tl_driver_inspect._specs import absolute_specs

    hook = "blocks.0.hook_resid_post"
    fixed = absolute_specs(
        {hook: [{"op": "add", "value": 1.0, "pos": [-1, 0]}, {"op": "suppress", "pos": -2}]}, 5
    )
    assert fixed == {
        hook: [{"op": "add", "value": 1.0, "pos": [4, 0]}, {"op": "suppress", "pos": 3}]
    }
    # -9 on a 5-token prompt would count from the end of prompt plus completion: refused.
    with pytest.raises(
        SpecError,
        match=r"'blocks\.0\.hook_resid_post': key 'pos' lists position -9, out of range "
        r"for a prompt of 5 tokens \(valid positions: -5\.\.4\)",
    ):
        absolute_specs({hook: [{"op": "suppress", "pos": -9}]}, 5)
    with pytest.raises(
        SpecError, match=r"names one position twice in a prompt of 5 tokens \(as \[4, 4\]\)"
    ):
        absolute_specs({hook: [{"op": "suppress", "pos": [-1, 4]}]}, 5)
