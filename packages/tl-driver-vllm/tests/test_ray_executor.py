"""The vllm driver on vLLM's Ray executor: TP=2 over Ray workers equals TP=2 over the
multiprocess executor, for every served hook, with and without specs on sharded sites, and
in steered generation.

vLLM's CPU build refuses its Ray executor outright (``QUARANTINES.md`` has the plain-vLLM
reproduction); the script this test runs lifts that one refusal with a test-only shim, so
that tl's side (its worker extension inside Ray workers, edit tables in, results out) runs
for real. ``scripts/gpu_check_vllm.py`` runs TP=2 over Ray on two GPUs with no shim (its
stage ``tp2-ray``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_tlv_ray_executor.py")


def test_tensor_parallel_2_over_ray_equals_the_multiprocess_executor(
    checkpoint: Any, tmp_path: Path
) -> None:
    folder = checkpoint("llama", num_key_value_heads=1)
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(folder), str(report_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=SCRIPT.parent,  # Ray's workers import the shim from here
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parent)},
    )
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(report_path.read_text())
    ranks = sorted(w["tp_rank"] for w in report["ray_workers"])
    assert ranks == [0, 1]
    assert all(w["pid"] != report["driver_pid"] for w in report["ray_workers"])
    assert report["ray_nodes"] and all(a == "127.0.0.1" for a in report["ray_nodes"])
    assert report["hooks"] > 40  # every served hook of a Llama block, both blocks
    worst = max(report["differences"].items(), key=lambda item: item[1])
    assert worst[1] <= 1e-5, f"largest difference {worst}"
    assert report["tokens_equal"]
