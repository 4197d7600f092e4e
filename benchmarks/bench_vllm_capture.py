"""Capture and steering cost inside one vLLM engine, as ratios to plain prefill throughput.

One engine, one run, interleaved repeats (median): plain vLLM prefill (``LLM.generate``
with one output token), then the tl driver cases of ``driver_cases``: nothing requested,
capture of every block's ``hook_out`` (values returned to the caller as tensors), one
steering spec on every prompt (intervention only, no capture, no logits), capture of every
head- and neuron-level site of every layer (q/k/v, rot_q/rot_k, z, MLP pre/pre_linear/post;
QK-norm sites where the family has them), ``hook_result`` of every layer, and attention
patterns rebuilt for every layer. Targets: residual capture >= 0.9x (0.85x before the
head-level sites existed), intervention-only >= 0.95x, every head- and neuron-level site
>= 0.7x of plain prefill; results and patterns have no target (they hold ``n_heads`` rows
of ``d_model``, and ``pos`` x ``pos`` per head). Both wall-clock and process CPU time are
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


_HEAD_SITES = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_z")
_NEURON_SITES = ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")


def driver_cases(driver: Any, gen: Any) -> list[tuple[str, dict[str, Any]]]:
    """The tl cases: a label and ``driver.forward`` keyword arguments (prompts aside).

    A list, so the same cases can run against engines booted in other modes.
    """
    import torch

    layers = driver.info.n_layers
    served = driver.namespace.served
    per_layer = [
        n for n in (f"blocks.{i}.{s}" for i in range(layers) for s in (*_HEAD_SITES, *_NEURON_SITES))
        if n in served
    ]  # fmt: skip
    per_layer += sorted(n for n in served if ".attn.q_norm." in n or ".attn.k_norm." in n)
    steer = {
        f"blocks.{layers // 2}.hook_out": {
            "op": "add", "value": torch.randn(driver.info.d_model, generator=gen).tolist(),
        }
    }  # fmt: skip
    base: dict[str, Any] = {"max_new_tokens": 0, "return_logits": False}
    return [
        ("tl driver, nothing requested", base),
        (f"capture all {layers} blocks.*.hook_out", {**base, "capture": [f"blocks.{i}.hook_out" for i in range(layers)]}),
        ("intervention only (1 add spec)", {**base, "intervene": steer}),
        (f"every head/neuron site ({len(per_layer)} hooks)", {**base, "capture": per_layer}),
        (f"hook_result of all {layers} layers", {**base, "capture": [f"blocks.{i}.attn.hook_result" for i in range(layers)]}),
        (f"patterns of all {layers} layers", {**base, "capture": [f"blocks.{i}.attn.hook_pattern" for i in range(layers)]}),
    ]


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
            kv_cache_memory_bytes=512 * 2**20, use_attn_result=True,
        )
        try:
            driver = bridge.driver
            llm = driver._llm
            gen = torch.Generator().manual_seed(0)
            prompts = torch.randint(4, driver.info.d_vocab, (args.prompts, args.tokens), generator=gen).tolist()
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
            requests = [{"prompt_token_ids": p} for p in prompts]
            cases: dict[str, Callable[[], Any]] = {
                "plain vLLM prefill": lambda: llm.generate(requests, params, use_tqdm=False),
            }
            for label, kwargs in driver_cases(driver, gen):
                cases[label] = lambda kwargs=kwargs: driver.forward(prompts, **kwargs)
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
    print(f"{'case':44s} {'tok/s wall':>11s} {'tok/CPU-s':>10s} {'ratio':>7s}")
    for key in times:
        wall, cpu = median(key, "wall"), median(key, "cpu")
        ratio = median("plain vLLM prefill", clock) / median(key, clock)
        rows.append(
            {"case": key, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu, "ratio": ratio}
        )
        print(f"{key:44s} {tokens / wall:11.0f} {tokens / cpu:10.0f} {ratio:6.2f}x")
    report = {
        "prompts": args.prompts, "tokens": args.tokens, "dtype": args.dtype, "clock": clock, "rows": rows
    }
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
