"""The benchmark scripts keep working (smoke runs; no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", ["bench_native_capture.py", "bench_hf_capture.py"])
def test_quick_run_prints_ratios_for_every_variant(script: str) -> None:
    args = [sys.executable, str(BENCH / script), "--quick", "--no-memory"]
    if "hf" in script:
        pytest.importorskip("tl_driver_hf")
        args.append("--no-optional")
    result = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    for variant in ("plain", "cache_resid", "cache_all"):
        row = next((line for line in lines if line.startswith(variant + " ")), None)
        assert row is not None, f"{variant!r} missing from:\n{result.stdout}"
