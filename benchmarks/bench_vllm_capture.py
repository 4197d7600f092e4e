"""Capture and steering cost inside one vLLM engine, as ratios to plain prefill throughput.

One engine, one run, interleaved repeats (median): plain vLLM prefill (``LLM.generate``
with one output token), the tl driver with nothing requested, capture of every block's
``hook_out`` (values returned to the caller as tensors), and one steering spec on every
prompt (intervention only, no capture, no logits). Targets: capture >= 0.85x and
intervention-only >= 0.95x of plain prefill. Both wall-clock and process CPU time are
recorded; on the CPU build the engine runs in this process, so CPU time measures the same
work and stays meaningful on a machine shared with other jobs (ratios use it by default
there); on a GPU the ratios use wall-clock time.

Usage::

    python benchmarks/bench_vllm_capture.py [--prompts 64] [--tokens 128] [--repeats 5]
        [--model FOLDER] [--dtype float32] [--json benchmarks/results/vllm_capture.json]

Without ``--model`` a random Llama-style checkpoint (8 layers, d_model 512) is written to a
temporary folder (needs ``tl_driver_hf.testing``). Runs the engine in-process on the CPU
build; on a GPU the same script measures the CUDA build.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The benchmarks folder is not a package: make _harness importable however this is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import time_call, write_json


def _setup_env(tmp: Path) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp / "cache"))
    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(tmp))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _checkpoint(tmp: Path, dtype: str) -> Path:
    from tl_driver_hf.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(
        "llama", tmp / "bench-llama", dtype=dtype, n_layers=8, d_model=512, head_dim=64,
        vocab_size=2048, n_ctx=1024,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, and return the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--clock", choices=("auto", "cpu", "wall"), default="auto",
        help="what the ratios use: process CPU time (in-process CPU engine; robust on a "
        "shared machine) or wall-clock time (GPU); auto picks cpu without CUDA",
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tl-bench-vllm-") as name:
        tmp = Path(name)
        _setup_env(tmp)
        import torch
        from vllm import SamplingParams

        from tl_core import RemoteBridge

        model = args.model or _checkpoint(tmp, args.dtype)
        bridge = RemoteBridge.boot_vllm(
            model, dtype=args.dtype, max_model_len=args.tokens + 8,
            max_num_batched_tokens=max(2048, args.tokens), max_num_seqs=args.prompts,
            kv_cache_memory_bytes=512 * 2**20,
        )
        try:
            driver = bridge.driver
            llm = driver._llm
            gen = torch.Generator().manual_seed(0)
            prompts = torch.randint(4, driver.info.d_vocab, (args.prompts, args.tokens), generator=gen).tolist()
            layers = driver.info.n_layers
            capture = [f"blocks.{i}.hook_out" for i in range(layers)]
            steer = {f"blocks.{layers // 2}.hook_out": {"op": "add", "value": torch.randn(driver.info.d_model, generator=gen).tolist()}}
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
            requests = [{"prompt_token_ids": p} for p in prompts]
            cases: dict[str, Callable[[], Any]] = {
                "plain vLLM prefill": lambda: llm.generate(requests, params, use_tqdm=False),
                "tl driver, nothing requested": lambda: driver.forward(prompts, max_new_tokens=0, return_logits=False),
                f"capture all {layers} blocks.*.hook_out": lambda: driver.forward(
                    prompts, capture=capture, max_new_tokens=0, return_logits=False
                ),
                "intervention only (1 add spec)": lambda: driver.forward(
                    prompts, intervene=steer, max_new_tokens=0, return_logits=False
                ),
            }
            for fn in cases.values():  # warm-up
                fn()
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
            for _ in range(args.repeats):
                for key, fn in cases.items():
                    times[key].append(time_call(fn))
            clock = args.clock
            if clock == "auto":
                clock = "wall" if torch.cuda.is_available() else "cpu"
        finally:
            bridge.close()
    tokens = args.prompts * args.tokens
    column = {"wall": 0, "cpu": 1}

    def median(key: str, which: str) -> float:
        return statistics.median(t[column[which]] for t in times[key])

    rows = []
    print(
        f"\n{args.prompts} prompts x {args.tokens} tokens, {args.dtype}, median of "
        f"{args.repeats}; ratios by {clock} time"
    )
    print(f"{'case':40s} {'tok/s wall':>11s} {'tok/CPU-s':>10s} {'ratio':>7s}")
    for key in times:
        wall, cpu = median(key, "wall"), median(key, "cpu")
        ratio = median("plain vLLM prefill", clock) / median(key, clock)
        rows.append(
            {"case": key, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu, "ratio": ratio}
        )
        print(f"{key:40s} {tokens / wall:11.0f} {tokens / cpu:10.0f} {ratio:6.2f}x")
    report = {
        "prompts": args.prompts, "tokens": args.tokens, "dtype": args.dtype, "clock": clock, "rows": rows
    }
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
