"""GPU check of the vllm driver: the CPU suite's parity, on the CUDA build of vLLM.

Each stage runs in its own subprocess (a fresh CUDA context and vLLM environment) and
prints one JSON line; the parent prints a report and exits 1 on any failure. Stages: one
per family (every served hook, head- and neuron-level sites and rebuilt patterns included,
and the logits of a ragged batch with chunked prefill: plain, with every residual spec op
per prompt, and with per-prompt specs on every head/neuron/norm site; steered greedy
generation), then tensor parallelism 2 and pipeline parallelism 2 when the machine has two
GPUs, and tensor parallelism 2 over vLLM's Ray executor (``distributed_executor_backend=
"ray"``, a Ray instance on the loopback address) when Ray is installed too; then the
compiled mode (issue #19): stage ``compiled`` boots Llama with ``enforce_eager=False`` (vLLM
compiled, piecewise CUDA graphs split at tl's capture op) and runs the same parity, its
three capture runs each on the compiled engine, an eager engine and both hf drivers at once
(``tests/_tlv_support.compare_modes``: also compiled within 1e-5 relative of eager), checks that
residual captures, edits and steered generation ran inside the graph (no Python hook on
decoder layer 0 fired) and that the engine runs piecewise CUDA graphs with the capture op
among vLLM's splitting ops; stage ``bench`` runs ``benchmarks/bench_vllm_capture.py
--compiled`` on the random checkpoint and checks issue #19's ratios against plain vLLM with
its defaults (full and piecewise CUDA graphs): nothing requested >= 0.97x in prefill and
decoding, residual capture of every layer >= 0.9x, one ``add`` spec >= 0.95x in prefill and
decoding. Float32, each result measured against the hf driver on the CPU in float64 and
required within the parity suite's ``VLLM_FACTOR`` times the float32 hf driver's own error
(``tl_core.certification.check_rounding``: a band that holds on any processor, GPU included);
generation against plain transformers; and a JumpReLU SAE spliced at one block with
per-prompt feature edits (logits and feature activations; the float64 reference runs the
dictionary in float64). Budget: under 10 minutes on one GPU.

Usage (a GPU machine with tl-core, tl-driver-hf and tl-driver-vllm[cuda] installed)::

    python scripts/gpu_check_vllm.py [--families llama,qwen3,gemma2,gpt2] [--allow-cpu]
        [--no-compiled]

``--allow-cpu`` runs the same stages on the CPU build, to check the script itself (there
the compiled engine has no CUDA graphs); ``--no-compiled`` leaves out the two compiled
stages.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "packages" / "tl-driver-vllm" / "tests"
FAMILIES = ("llama", "qwen3", "gemma2", "gpt2")


def _stage(name: str, family: str, tmp: Path) -> dict[str, Any]:
    """Run one stage in this process and return its report."""
    sys.path.insert(0, str(TESTS))
    import torch
    from _tlv_reference import Reference  # the test suite's transformers reference
    from _tlv_support import VLLM_FACTOR, compare_modes, prompt_part
    from test_parity import _per_prompt_specs, _prompts, _site_specs

    from tl_core import RemoteBridge, TransformerBridge
    from tl_core.certification import check_rounding
    from tl_core.sae import random_dictionary
    from tl_driver_hf.testing import write_tiny_checkpoint

    def ratio(got: Any, peer: Any, exact: Any) -> float:
        """The error against float64 as a multiple of the allowed one (<= 1 passes)."""
        if got.shape != peer.shape:
            return float("inf")
        return check_rounding(got.cpu(), peer, exact, factor=VLLM_FACTOR).ratio

    folder = write_tiny_checkpoint(family, tmp / f"{family}-{name}")
    options: dict[str, Any] = {
        "dtype": "float32",
        "max_num_batched_tokens": 32,
        "max_num_seqs": 8,
        "max_model_len": 256,
        "kv_cache_memory_bytes": 256 * 2**20,
        "use_attn_result": True,
    }
    if torch.cuda.is_available():
        options["gpu_memory_utilization"] = 0.3
    if name == "tp2":
        options["tensor_parallel_size"] = 2
    if name == "pp2":
        options["pipeline_parallel_size"] = 2
    if name == "tp2-ray":
        options["tensor_parallel_size"] = 2
        options["distributed_executor_backend"] = "ray"
    if name == "compiled":
        options["enforce_eager"] = False
        # Fewer CUDA-graph sizes than vLLM's default list: the stage's steps are small.
        options["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
    else:
        options["enforce_eager"] = True
    start = time.perf_counter()
    bridge = RemoteBridge.boot_vllm(folder, **options)
    boot = time.perf_counter() - start
    report: dict[str, float] = {}
    try:
        driver, ref = bridge.driver, Reference(folder)
        hf_bridge, exact_bridge = (
            TransformerBridge.boot_transformers(
                str(folder), dtype=dtype, use_attn_result=True, device="cpu"
            )
            for dtype in (torch.float32, torch.float64)
        )
        hf, exact = hf_bridge.driver, exact_bridge.driver
        prompts = _prompts(driver.info.d_vocab)
        served = sorted(driver.supported_hook_points)
        specs = _per_prompt_specs(driver.info.d_model, driver.supported_hook_points)
        site_specs, _ = _site_specs(driver.namespace, seed=11)
        parity_runs = (("plain", None), ("specs", specs), ("site specs", site_specs))
        # The compiled stage runs these against the hf drivers and an eager engine at once
        # (compare_modes, below).
        for label, intervene in parity_runs if name != "compiled" else ():
            result = driver.forward(prompts, capture=served, intervene=intervene, max_new_tokens=0)
            want = hf.forward(prompts, capture=served, intervene=intervene, max_new_tokens=0)
            truth = exact.forward(prompts, capture=served, intervene=intervene, max_new_tokens=0)
            for b, ids in enumerate(prompts):
                n = len(ids)
                for hook in served:
                    key = f"{label}:{hook}"
                    got, peer, sure = (
                        prompt_part(r.captured[hook], b, n) for r in (result, want, truth)
                    )
                    report[key] = max(report.get(key, 0.0), ratio(got, peer, sure))
                key = f"{label}:logits"
                report[key] = max(
                    report.get(key, 0.0),
                    ratio(result.logits[b, :n], want.logits[b, :n], truth.logits[b, :n]),
                )
        steer = [{"blocks.0.hook_out": {"op": "add", "value": 2.0}}, None]
        chosen = prompts[:2]
        out = driver.forward(chosen, intervene=steer, max_new_tokens=6, stop_at_eos=False)
        assert out.new_tokens is not None
        same = all(
            out.new_tokens[b].tolist() == ref.generate(ids, 6, steer[b])
            for b, ids in enumerate(chosen)
        )
        report["generate: greedy tokens differ"] = 0.0 if same else float("inf")
        # A dictionary inside the engine: per-prompt feature edits, logits and features.
        sae = random_dictionary(
            driver.info.d_model, 4 * driver.info.d_model, seed=5, scale=0.2, architecture="jumprelu"
        )
        acts = "blocks.1.hook_out.hook_sae_acts_post"
        edits: list[Any] = [None] * len(prompts)
        edits[0] = {acts: {"op": "add", "value": 3.0, "features": [1, 2], "pos": -1}}
        edits[-1] = {
            acts: {"op": "suppress", "features": list(range(0, 4 * driver.info.d_model, 5))}
        }
        runs = []
        for b, dictionary in (
            (bridge, sae),
            (hf_bridge, sae),
            (exact_bridge, sae.to(dtype=torch.float64)),
        ):
            spliced = b.add_sae(dictionary, hook_name="blocks.1.hook_out")
            try:
                runs.append(
                    b.driver.forward(prompts, capture=[acts], intervene=edits, max_new_tokens=0)
                )
            finally:
                spliced.remove()
        for b, ids in enumerate(prompts):
            n = len(ids)
            for key, pick in (
                ("sae:logits", lambda r: r.logits),
                (f"sae:{acts}", lambda r: r.captured[acts]),
            ):
                got, peer, sure = (prompt_part(pick(r), b, n) for r in runs)
                report[key] = max(report.get(key, 0.0), ratio(got, peer, sure))
        if name == "compiled":
            # Before a second in-process engine: closing it tears down vLLM's process groups.
            report.update(_inside_the_graph(driver, prompts))
            eager_options = {k: v for k, v in options.items() if k != "compilation_config"}
            eager = RemoteBridge.boot_vllm(folder, **{**eager_options, "enforce_eager": True})
            try:
                engines = (driver, eager.driver, hf, exact)
                for label, intervene in parity_runs:
                    report.update(compare_modes(engines, prompts, served, intervene, f"{label}:"))
            finally:
                eager.close()
    finally:
        bridge.close()
    worst = max(report, key=lambda k: report[k])
    return {
        "stage": f"{family}/{name}",
        "boot_s": round(boot, 1),
        "checks": len(report),
        "worst": worst,
        "worst_ratio": report[worst],
        "ok": report[worst] <= 1.0,
    }


def _inside_the_graph(driver: Any, prompts: list[list[int]]) -> dict[str, float]:
    """Checks (0 passes, inf fails) that a compiled engine's residual-stream runs stayed in
    its graph and that its graphs are piecewise, split at tl's capture op."""
    import torch
    from _tlv_support import layer_calls

    from tl_driver_vllm._worker_side._resident import VISIT_OP

    d = driver.info.d_model
    calls, handle = layer_calls(driver)
    try:
        driver.forward(prompts, capture=["blocks.0.hook_in", "ln_final.hook_in"], max_new_tokens=0)
        steer = [{"blocks.1.hook_in": {"op": "add", "value": [0.5] * d}}, None]
        driver.forward(
            prompts[:2], intervene=steer, capture=["blocks.1.hook_out"], max_new_tokens=4
        )
    finally:
        handle.remove()
    report = {"graph: Python hook calls in residual runs": 0.0 if not calls else float("inf")}
    if torch.cuda.is_available():

        def graphs(worker: Any) -> tuple[str, list[str]]:
            config = worker.vllm_config.compilation_config
            return config.cudagraph_mode.name, list(config.splitting_ops or [])

        [(mode, splits)] = driver._llm.collective_rpc(graphs)
        good = mode == "PIECEWISE" and VISIT_OP in splits
        report[f"graph: CUDA graphs {mode}, capture op split"] = 0.0 if good else float("inf")
    return report


def _bench(tmp: Path) -> dict[str, Any]:
    """Issue #19's throughput ratios against plain vLLM's defaults (the random checkpoint)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_vllm_capture as bench

    argv = ["--models", "random", "--modes", "in-process", "--compiled", "--repeats", "3"]
    got = bench.main([*argv, "--json", str(tmp / "bench.json")])
    ratios = got["models"]["random (against vLLM defaults)"]["in-process"]
    short = {case: round(ratios[case], 3) for case in bench.DEFAULT_TARGETS}
    misses = {c: v for c, v in short.items() if v < bench.DEFAULT_TARGETS[c]}
    worst = min(short, key=lambda c: short[c] / bench.DEFAULT_TARGETS[c])
    return {
        "stage": "random/bench",
        "boot_s": 0.0,
        "checks": len(short),
        "worst": f"{worst} ({short[worst]}x, target {bench.DEFAULT_TARGETS[worst]}x)",
        "worst_ratio": bench.DEFAULT_TARGETS[worst] / short[worst],
        "ratios": short,
        "ok": not misses,
    }


def _run_stage(name: str, family: str, allow_cpu: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if name in ("tp2", "pp2", "tp2-ray"):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if name == "tp2-ray":  # Ray and vLLM on the loopback address only
        env.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "VLLM_HOST_IP": "127.0.0.1"})
    else:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cmd = [sys.executable, __file__, "--stage", name, "--family", family]
    if allow_cpu:
        cmd.append("--allow-cpu")
    proc = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600 if name in ("compiled", "bench") else 300,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    tail = (proc.stderr or proc.stdout)[-1500:]
    return {"stage": f"{family}/{name}", "ok": False, "error": tail}


def main(argv: list[str] | None = None) -> int:
    """Run every stage (or one, with ``--stage``); print the report; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--allow-cpu", action="store_true")
    parser.add_argument("--no-compiled", action="store_true")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--family", default="llama", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0 and not args.allow_cpu:
        print("no CUDA device: run on a GPU machine, or pass --allow-cpu to check the script")
        return 2
    if args.stage is not None:
        with tempfile.TemporaryDirectory(prefix="tl-gpu-check-") as tmp:
            os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tmp) / "cache"))
            os.environ.setdefault("VLLM_RPC_BASE_PATH", tmp)
            run = _bench if args.stage == "bench" else partial(_stage, args.stage, args.family)
            print(json.dumps(run(Path(tmp))))
        return 0
    started = time.perf_counter()
    stages = [("tp1", family) for family in args.families.split(",")]
    has_ray = importlib.util.find_spec("ray") is not None
    if gpus >= 2:
        stages += [("tp2", "llama"), ("pp2", "llama")]
        if has_ray:
            stages.append(("tp2-ray", "llama"))
    if not args.no_compiled:
        stages += [("compiled", "llama"), ("bench", "random")]
    results = [_run_stage(name, family, args.allow_cpu) for name, family in stages]
    print(
        f"\nvllm driver GPU check on {gpus} GPU(s) ({torch.cuda.get_device_name(0) if gpus else 'CPU'})"
    )
    if gpus < 2:
        print("tensor/pipeline parallelism 2: skipped (needs two GPUs)")
    elif not has_ray:
        print("tensor parallelism 2 over Ray: skipped (pip install 'tl-core[ray]')")
    for r in results:
        status = "PASS" if r["ok"] else "FAIL"
        detail = (
            r.get("error")
            or f"{r['checks']} checks, worst {r['worst']} at {r['worst_ratio']:.2f}x the allowed error, boot {r['boot_s']}s"
        )
        print(f"{status}  {r['stage']:14s} {detail}")
    print(f"total {time.perf_counter() - started:.0f}s")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
