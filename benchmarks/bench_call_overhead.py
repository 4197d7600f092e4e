"""What one bridge call costs on top of the engine's own forward, on a tiny model.

On a model this small the engine's work is a few milliseconds, so the ratio of a bridge
call to a plain forward of the same engine is mostly tl's per-call work: tokens, name
resolution, spec planning, hook wiring, result assembly. For each driver (``native``,
``hf``, ``vllm`` in-process), interleaved rounds time:

- ``plain``: the engine alone, the baseline (the native ``nn.Module``; the transformers
  model; ``LLM.generate`` with one output token on the driver's own engine);
- ``forward``: ``bridge(ids)``, logits only;
- ``cache_spec``: ``bridge.run_with_cache(ids, names_filter=[2 hooks], intervene={add})``,
  the call ``ForwardRequest`` was built for;
- ``stop_early``: ``run_with_cache(..., stop_at_layer=1)`` with the same names.

``--against REV`` measures the same in one run against another commit: it checks ``REV``
out into a temporary git worktree and alternates child processes of this script on the
two trees (``PYTHONPATH`` puts a tree's package sources first), several times each, and
reports the median ratio of each tree side by side.

Usage::

    python benchmarks/bench_call_overhead.py [--drivers native,hf,vllm] [--repeats 30]
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_call_overhead.py --against HEAD~1

The hf and vllm rows need ``tl_driver_hf.testing`` (a tiny random checkpoint) and, for
vllm, ``tl-driver-vllm`` with a vLLM build.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import environment_line, format_table, summarize, time_interleaved

ROOT = Path(__file__).resolve().parent.parent
_NAMES = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"]
_SPEC = {"blocks.0.hook_out": {"op": "add", "value": 0.5}}
_VARIANTS = ("forward", "cache_spec", "stop_early")


def _prompts() -> list[list[int]]:
    return [[1 + (7 * i + j) % 200 for j in range(24 - 8 * i)] for i in range(2)]


def _cases(driver: str, folder: Path) -> tuple[Callable[[], Any], Any]:
    """The baseline call and the booted bridge of one driver."""
    import torch

    from tl_core import RemoteBridge, TransformerBridge

    rows = _prompts()
    if driver == "native":
        bridge = TransformerBridge.boot_native("llama", n_layers=2, d_model=64, n_ctx=64)
        ids = torch.tensor([rows[0]])
        return lambda: bridge.model(ids), bridge
    if driver == "hf":
        bridge = TransformerBridge.boot_transformers(str(folder), dtype=torch.float32)
        model = bridge.driver.hf_model
        ids = torch.tensor([rows[0]])

        def plain_hf() -> Any:
            with torch.no_grad():
                return model(input_ids=ids).logits

        return plain_hf, bridge
    bridge = RemoteBridge.boot_vllm(str(folder), dtype="float32", max_model_len=64)
    from vllm import SamplingParams

    llm = bridge.driver._llm
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    prompts = [{"prompt_token_ids": rows[0]}]
    return lambda: llm.generate(prompts, params, use_tqdm=False), bridge


def measure(drivers: list[str], repeats: int) -> dict[str, dict[str, float]]:
    """Driver -> variant -> median time as a ratio to that driver's ``plain``."""
    import torch

    torch.set_num_threads(1)
    ratios: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-llama"
        if set(drivers) & {"hf", "vllm"}:
            from tl_driver_hf.testing import write_tiny_checkpoint

            write_tiny_checkpoint("llama", folder)
        row = [_prompts()[0]]
        for driver in drivers:
            plain, bridge = _cases(driver, folder)
            fns: dict[str, Callable[[], Any]] = {
                "plain": plain,
                "forward": lambda b=bridge: b(row, prepend_bos=False),
                "cache_spec": lambda b=bridge: b.run_with_cache(
                    row, names_filter=_NAMES, intervene=_SPEC, prepend_bos=False
                ),
                "stop_early": lambda b=bridge: b.run_with_cache(
                    row, names_filter=_NAMES[:1], stop_at_layer=1, prepend_bos=False
                ),
            }
            with torch.no_grad():
                samples = time_interleaved(fns, repeats=repeats, warmup=3)
            base = summarize(samples["plain"]).median
            ratios[driver] = {v: summarize(samples[v]).median / base for v in _VARIANTS}
            close = getattr(bridge, "close", None)
            if callable(close):
                close()
    return ratios


def _child(tree: Path, drivers: list[str], repeats: int) -> dict[str, dict[str, float]]:
    sources = [
        str(p / "src") for p in sorted((tree / "packages").iterdir()) if (p / "src").is_dir()
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sources))
    command = [
        sys.executable, str(Path(__file__).resolve()), "--drivers", ",".join(drivers),
        "--repeats", str(repeats), "--child",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the run on {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def against(rev: str, drivers: list[str], repeats: int, rounds: int) -> None:
    """Alternate runs of this tree and of ``rev``; print both trees' median ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(other), rev],
            check=True,
        )
        try:
            runs: dict[str, list[dict[str, dict[str, float]]]] = {"this tree": [], rev: []}
            for index in range(rounds):
                order = [("this tree", ROOT), (rev, other)]
                for label, tree in order if index % 2 == 0 else order[::-1]:
                    runs[label].append(_child(tree, drivers, repeats))
                    print(f"  round {index + 1}/{rounds}: {label} done", file=sys.stderr)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False
            )
    rows = []
    for driver in drivers:
        for variant in _VARIANTS:
            mine = statistics.median(r[driver][variant] for r in runs["this tree"])
            theirs = statistics.median(r[driver][variant] for r in runs[rev])
            rows.append(
                [f"{driver} {variant}", f"{mine:.3f}", f"{theirs:.3f}", f"{mine / theirs:.3f}"]
            )
    print(environment_line())
    print(f"median over {rounds} runs per tree, {repeats} rounds each; ratios to plain")
    print(format_table(["call", "this tree", rev, "this / " + rev], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drivers", default="native,hf,vllm")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds per run")
    parser.add_argument("--against", metavar="REV", help="also run commit REV, alternating")
    parser.add_argument("--rounds", type=int, default=4, help="runs per tree with --against")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    drivers = [d for d in args.drivers.split(",") if d]
    unknown = sorted(set(drivers) - {"native", "hf", "vllm"})
    if unknown:
        parser.error(f"unknown drivers {unknown}; choose from native, hf, vllm")
    if args.against:
        against(args.against, drivers, args.repeats, args.rounds)
        return
    ratios = measure(drivers, args.repeats)
    if args.child:
        print(json.dumps(ratios))
        return
    print(environment_line())
    rows = [[f"{d} {v}", f"{r[v]:.3f}"] for d, r in ratios.items() for v in _VARIANTS]
    print(format_table(["call", "ratio to plain"], rows))


if __name__ == "__main__":
    main()
