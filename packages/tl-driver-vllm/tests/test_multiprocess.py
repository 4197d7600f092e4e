"""vLLM's default mode (engine core in its own process): every served hook through shared
memory, equal to the hf driver's; the same run as bytes where shared memory is not usable;
on an eager engine and a compiled one (the default: residual-stream runs and
logits inside the compiled graph, runs with other hooks its eager forward).

Its own module: vLLM caches its environment while an engine lives, so the mode switch
below must not meet another module's in-process engine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import ENGINE_SIZES, check, diff, prompt_part, rounding_ratio  # noqa: E402

from tl_core import RemoteBridge, TransformerBridge  # noqa: E402
from tl_driver_vllm._wire import SharedFiles  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 80)), [60, 61]]  # 70 tokens: chunked prefill


def _largest(x: Any) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def _carriers(received: list[Any]) -> set[str]:
    """How the workers' tensors crossed: ``file`` (shared memory) or ``data`` (bytes)."""
    return {
        "file" if "file" in p else "data"
        for run in received
        for r in run
        for p in r["batched"].values()
    }


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_default_mode_serves_every_hook_through_shared_memory_or_bytes(
    checkpoint: Any, monkeypatch: pytest.MonkeyPatch, eager: bool
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    folder = checkpoint("llama")
    bridge = RemoteBridge.boot_vllm(
        folder, dtype="float32", use_attn_result=True, enforce_eager=eager, **ENGINE_SIZES
    )
    shared = bridge.driver._shared
    try:
        driver = bridge.driver
        assert not driver._raw and all(w["pid"] != os.getpid() for w in driver.workers)
        assert all(w["compiled"] is not eager for w in driver.workers)
        assert shared.folder is not None, "no shared-memory folder in the default mode"
        received: list[Any] = []

        def spied(files: SharedFiles) -> SharedFiles:
            receive = files.receive

            def spy(results: Any) -> Any:
                received.append(results)
                return receive(results)

            monkeypatch.setattr(files, "receive", spy)
            return files

        spied(shared)
        capture = sorted(driver.supported_hook_points)
        assert {
            "blocks.1.attn.hook_pattern",
            "blocks.1.attn.hook_result",
            "blocks.0.mlp.hook_post",
        } <= set(capture)
        vec = torch.linspace(-1, 1, driver.info.d_model).tolist()
        intervene = [None, {"blocks.0.hook_out": {"op": "add", "value": vec, "pos": [3, 50]}}, None]
        result = driver.forward(PROMPTS, capture=capture, intervene=intervene, max_new_tokens=0)
        last = driver.forward(PROMPTS, max_new_tokens=0, return_logits="last")
        # On the compiled engine, a run that only reads and adds to the residual stream
        # runs inside the compiled graph (the others above run its eager forward).
        stream = [
            k for k in capture if re.fullmatch(r"blocks\.\d+\.hook_(in|out)|ln_final\.hook_in", k)
        ]
        residual = driver.forward(PROMPTS, capture=stream, intervene=intervene, max_new_tokens=0)
        assert _carriers(received) == {"file"}, "every tensor crosses as a shared-memory file"
        assert os.listdir(shared.folder) == ["probe"]

        # Where shared memory is not usable, the same run crosses as bytes.
        received.clear()
        driver._shared = spied(SharedFiles(enabled=False))
        fallback = driver.forward(PROMPTS, capture=capture, intervene=intervene, max_new_tokens=0)
        assert _carriers(received) == {"data"}
        driver._shared = shared

        hf, exact = (
            TransformerBridge.boot_transformers(
                str(folder), dtype=dtype, use_attn_result=True
            ).driver
            for dtype in (torch.float32, torch.float64)
        )
        want = hf.forward(PROMPTS, capture=capture, intervene=intervene, max_new_tokens=0)
        truth = exact.forward(PROMPTS, capture=capture, intervene=intervene, max_new_tokens=0)
        plain = hf.forward(PROMPTS, max_new_tokens=0)
        plain_truth = exact.forward(PROMPTS, max_new_tokens=0)
        # Against the hf driver: vLLM's error against float64 over the allowed one; within
        # the engine (bytes vs shared memory, padding): a plain difference.
        ratios: dict[str, float] = {}
        report: dict[str, float] = {}
        for b, ids in enumerate(PROMPTS):
            n = len(ids)
            for k in capture:
                got = prompt_part(result.captured[k], b, n)
                ratios[f"p{b}:{k}"] = rounding_ratio(
                    got, *(prompt_part(r.captured[k], b, n) for r in (want, truth)), k
                )
                report[f"p{b}:bytes:{k}"] = diff(prompt_part(fallback.captured[k], b, n), got)
                if k.endswith(("hook_pattern", "hook_attn_scores")):
                    continue  # square maps: their padding is each prompt's own business
                report[f"p{b}:pad:{k}"] = _largest(result.captured[k][b, n:])
            ratios[f"p{b}:logits"] = rounding_ratio(
                result.logits[b, :n], want.logits[b, :n], truth.logits[b, :n]
            )
            report[f"p{b}:bytes:logits"] = diff(fallback.logits[b, :n], result.logits[b, :n])
            for k in [*stream, "logits"]:
                ours = residual.logits if k == "logits" else residual.captured[k]
                theirs = want.logits if k == "logits" else want.captured[k]
                exact_value = truth.logits if k == "logits" else truth.captured[k]
                ratios[f"p{b}:stream:{k}"] = rounding_ratio(
                    prompt_part(ours, b, n), prompt_part(theirs, b, n),
                    prompt_part(exact_value, b, n), k,
                )  # fmt: skip
            ratios[f"p{b}:last"] = rounding_ratio(
                last.logits[b, 0], plain.logits[b, n - 1], plain_truth.logits[b, n - 1]
            )
        check(
            ratios,
            1.0,
            "default multiprocess mode vs the hf driver, error / allowed against float64",
        )
        check(report, 1e-4, "default multiprocess mode within the engine")
    finally:
        folder_path = shared.folder
        bridge.close()
    assert folder_path is not None and not Path(folder_path).exists()
