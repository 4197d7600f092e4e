"""``eval_dataframe`` and ``load_activations`` on real offline evals with captures."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
torch = pytest.importorskip("torch")

from inspect_ai import Task, eval as inspect_eval  # noqa: E402
from inspect_ai.dataset import Sample  # noqa: E402
from inspect_ai.scorer import includes  # noqa: E402

from tl_core import RemoteBridge, UserError  # noqa: E402
from tl_driver_inspect import capture_activations, eval_dataframe, load_activations  # noqa: E402

pytestmark = pytest.mark.slow

HOOKS = ["blocks.0.hook_out", "blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern"]
WORDS = ["lamp", "tea", "stairs", "green"]


@pytest.fixture(scope="module")
def bridge(checkpoint: Path) -> Iterator[RemoteBridge]:
    with warnings.catch_warnings():  # the provider-name clash warning (TransformerLens 4.3)
        warnings.simplefilter("ignore", UserWarning)
        remote = RemoteBridge.boot_inspect(checkpoint)
    yield remote
    remote.close()


def _task(solver: Any, target: str | None = None) -> Task:
    data = [
        Sample(input=f"Repeat: {w}", target=target or w, id=f"s{i}") for i, w in enumerate(WORDS)
    ]
    return Task(dataset=data, solver=solver, scorer=includes(), epochs=2)


@pytest.fixture(scope="module")
def captured(bridge: RemoteBridge, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    root = tmp_path_factory.mktemp("analysis")
    # One sample answers right whatever the model says: scores differ across rows.
    task = _task([capture_activations(HOOKS, output_dir=str(root / "acts"))])
    task.dataset[0].target = [""]
    (log,) = inspect_eval(
        task,
        model=bridge.driver.inspect_model,
        log_dir=str(root / "logs"),
        display="none",
        max_tokens=5,
    )
    assert log.status == "success", log.error
    return log, root


def test_eval_dataframe_columns(captured: Any) -> None:
    log, root = captured
    frame = eval_dataframe(log)
    assert len(frame) == 8
    assert list(frame[["id", "epoch"]].itertuples(index=False, name=None)) == [
        (f"s{i}", e) for i in range(4) for e in (1, 2)
    ]
    for column in (
        "score_includes",
        "tl_file",
        "tl_tokens",
        "tl_prompt_tokens",
        "tl_hooks",
        "tl_summary",
    ):
        assert column in frame.columns, column
    canonical = ["blocks.0.hook_out", "blocks.1.hook_out", "blocks.0.attn.hook_pattern"]
    for name in canonical:
        assert f"tl_norm.{name}" in frame.columns and f"tl_shape.{name}" in frame.columns
    row = frame.iloc[0]
    assert Path(row["tl_file"]).is_file() and row["tl_file"].endswith("s0_epoch1.safetensors")
    assert sorted(row["tl_hooks"]) == sorted(canonical)
    assert row["tl_shape.blocks.1.hook_out"][0] == row["tl_tokens"] > row["tl_prompt_tokens"] > 0
    assert set(frame["score_includes"]) <= {"C", "I"} and frame.loc[0, "score_includes"] == "C"
    same = eval_dataframe(log.location)
    assert same["tl_file"].tolist() == frame["tl_file"].tolist()
    assert len(eval_dataframe(root / "logs")) == 8


def test_load_activations_is_the_capture(captured: Any, bridge: RemoteBridge) -> None:
    log, _ = captured
    frame = eval_dataframe(log)
    x, y, rows = load_activations(frame, "blocks.1.hook_resid_post")
    assert x.shape == (8, bridge.cfg.d_model) and x.dtype == torch.float32
    assert y.tolist() == [1.0 if s == "C" else 0.0 for s in frame["score_includes"]]
    assert rows["id"].tolist() == frame["id"].tolist()
    norms = [float(n) for n in frame["tl_norm.blocks.1.hook_out"]]
    full, _, _ = load_activations(frame, "blocks.1.hook_out", position="mean")
    assert full.shape == x.shape
    # the captured rows are the model's own residual stream at those tokens
    from safetensors import safe_open

    with safe_open(frame.loc[3, "tl_file"], "pt") as handle:
        tokens = handle.get_tensor("tokens").tolist()
        stored = handle.get_tensor("blocks.1.hook_out")
    assert abs(float(stored.norm()) - norms[3]) < 1e-4
    _, cache = bridge.run_with_cache([tokens], names_filter=["blocks.1.hook_out"])
    assert torch.allclose(cache["blocks.1.hook_out"][0, -1], x[3], atol=1e-5)
    first, _, _ = load_activations(frame, "blocks.1.hook_out", position=0)
    assert torch.allclose(first[3], cache["blocks.1.hook_out"][0, 0], atol=1e-5)
    same_length = frame[frame["tl_tokens"] == frame.loc[0, "tl_tokens"]]
    pattern, _, _ = load_activations(same_length, "blocks.0.attn.hook_pattern", position=-1)
    heads = bridge.cfg.n_heads
    assert pattern.shape == (
        len(same_length),
        heads * int(frame.loc[0, "tl_tokens"]),
    )  # last query's row per head
    if frame["tl_tokens"].nunique() > 1:
        with pytest.raises(UserError, match="different widths"):
            load_activations(frame, "blocks.0.attn.hook_pattern")


def test_load_activations_selects_samples(captured: Any) -> None:
    log, _ = captured
    frame = eval_dataframe(log)
    x, _, rows = load_activations(log, "blocks.0.hook_out", samples=["s2", ("s0", 2)])
    assert list(rows[["id", "epoch"]].itertuples(index=False, name=None)) == [
        ("s2", 1),
        ("s2", 2),
        ("s0", 2),
    ]
    assert x.shape[0] == 3
    mask = frame["epoch"] == 1
    x, _, rows = load_activations(frame, "blocks.0.hook_out", samples=mask)
    assert rows["epoch"].tolist() == [1] * 4 and x.shape[0] == 4
    with pytest.raises(UserError, match="no sample 'nope'"):
        load_activations(frame, "blocks.0.hook_out", samples=["nope"])


def test_reduced_captures(bridge: RemoteBridge, tmp_path: Path) -> None:
    task = _task(
        [
            capture_activations(
                ["blocks.1.hook_out"], output_dir=str(tmp_path / "acts"), reduce="mean"
            )
        ]
    )
    (log,) = inspect_eval(
        task,
        model=bridge.driver.inspect_model,
        log_dir=str(tmp_path / "logs"),
        display="none",
        max_tokens=3,
    )
    x, _, frame = load_activations(log, "blocks.1.hook_out")
    assert x.shape == (8, bridge.cfg.d_model)
    assert frame.loc[0, "tl_shape.blocks.1.hook_out"] == [bridge.cfg.d_model]
    with pytest.raises(UserError, match="reduce='mean'"):
        load_activations(frame, "blocks.1.hook_out", position=0)


def test_clear_errors(captured: Any, tmp_path: Path) -> None:
    log, _ = captured
    frame = eval_dataframe(log)
    with pytest.raises(UserError) as caught:
        load_activations(frame, "blocks.1.mlp.hook_out")
    message = str(caught.value)
    assert (
        "s0_epoch1.safetensors" in message
        and "'blocks.0.hook_out'" in message
        and "tokens" not in message.split("holds")[1]
    )
    moved = frame.copy()
    moved.loc[0, "tl_file"] = str(tmp_path / "gone.safetensors")
    with pytest.raises(UserError, match=r"missing: .*gone.safetensors"):
        load_activations(moved, "blocks.0.hook_out")
    with pytest.raises(UserError, match=r"no sample of .* store key 'other'"):
        eval_dataframe(log, store_key="other")
    with pytest.raises(UserError, match="position"):
        load_activations(frame, "blocks.0.hook_out", position="first")


def test_missing_pandas_names_the_extra(captured: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(
        ImportError,
        match=r"tl-driver-inspect\[analysis\].*pyarrow|pyarrow.*tl-driver-inspect\[analysis\]",
    ):
        eval_dataframe(captured[0])
