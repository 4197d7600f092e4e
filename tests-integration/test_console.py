"""The installed `tl` console script, run as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.integration


def _tl(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("tl")
    assert exe is not None, "the tl console script is not installed"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_tl_drivers_lists_every_installed_driver() -> None:
    result = _tl("drivers", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["native"]["status"] == "ok"
    for row in rows.values():
        if (
            "tl-fake" not in row["distribution"]
        ):  # fixtures of tl-core's own suite are broken on purpose
            assert row["status"] == "ok", row


def test_tl_demo_native_prints_every_section() -> None:
    result = _tl("demo", "--native", "--layers", "2", "--preset", "llama")
    assert result.returncode == 0, result.stderr
    for heading in (
        "== capture",
        "== intervention",
        "== residual-stream analysis",
        "== generation",
    ):
        assert heading in result.stdout


def test_unknown_driver_exits_with_the_install_line() -> None:
    script = "import tl_core; tl_core.boot('m', driver='vllm')"
    exe = shutil.which("python")
    assert exe
    result = subprocess.run([exe, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "pip install tl-driver-vllm" in result.stderr
