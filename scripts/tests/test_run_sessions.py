"""The lane runner: every session runs, logs stay whole, a failure fails the run (``nox -s docs``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import run_sessions

#: A stand-in for ``nox -s NAME``: prints numbered lines slowly, fails when its name says so.
_FAKE = """
import sys, time
name = sys.argv[1]
for i in range(20):
    print(f"{name} line {i}", flush=True)
    time.sleep(0.01)
sys.exit(3 if name.startswith("bad") else 0)
"""


def _runner(lanes: list[list[str]], tmp_path: Path) -> run_sessions.Runner:
    return run_sessions.Runner(
        lanes, lambda name: [sys.executable, "-c", _FAKE, name], logs=tmp_path / "logs"
    )


def test_every_session_runs_once_in_its_lane_and_its_log_prints_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outcomes = _runner([["a", "b"], ["c", "d", "e"]], tmp_path).run()
    assert sorted((o.name, o.lane, o.returncode) for o in outcomes) == [
        ("a", 0, 0), ("b", 0, 0), ("c", 1, 0), ("d", 1, 0), ("e", 1, 0),
    ]  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    for name in "abcde":
        lines = [i for i, line in enumerate(printed) if line.startswith(f"{name} line ")]
        assert lines == list(range(lines[0], lines[0] + 20)), f"{name}'s log was interleaved"
    # A lane runs its sessions in order.
    start = {o.name: o.start for o in outcomes}
    assert start["a"] < start["b"] and start["c"] < start["d"] < start["e"]


def test_a_failing_session_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    outcomes = _runner([["bad-one", "after"], ["other"]], tmp_path).run()
    codes = {o.name: o.returncode for o in outcomes}
    assert codes == {"bad-one": 3, "after": 0, "other": 0}
    table = run_sessions.summary(outcomes, 12.0)
    assert "bad-one" in table and "FAILED" in table and table.count("passed") == 2


def test_sessions_not_placed_join_the_lane_with_fewest_and_absent_ones_are_dropped() -> None:
    # LANES puts vllm in lane 0 and ray and lint in lane 1; a new session joins the lane with
    # the fewest sessions (the first of equals).
    assert run_sessions.plan_lanes(["vllm", "lint", "new_session"]) == [
        ["vllm", "new_session"],
        ["lint"],
    ]
    assert run_sessions.plan_lanes(["lint"]) == [["lint"]]


def test_log_names_are_plain_file_names() -> None:
    assert run_sessions.log_name("tests(package='tl-core')") == "tests-tl-core"
    assert run_sessions.log_name("vllm") == "vllm"


def test_lane_one_runs_one_thread_unless_the_caller_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    show = "import os, sys; print(sys.argv[1], os.environ.get('OMP_NUM_THREADS'))"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    runner = run_sessions.Runner(
        [["zero"], ["one"]], lambda name: [sys.executable, "-c", show, name], tmp_path / "logs"
    )
    runner.run()
    logs = {n: (tmp_path / "logs" / f"{n}.log").read_text().split() for n in ("zero", "one")}
    assert logs == {"zero": ["zero", "None"], "one": ["one", "1"]}
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    runner = run_sessions.Runner(
        [[], ["one"]], lambda name: [sys.executable, "-c", show, name], tmp_path / "logs"
    )
    runner.run()
    assert (tmp_path / "logs" / "one.log").read_text().split() == ["one", "2"]
