"""What ``capture_activations`` adds to an inspect_ai eval's wall time.

One model (``tl_bridge/<folder>``, built once and shared), one dataset, two tasks that
differ only in the solver: ``generate()`` (the baseline) and
``capture_activations(hooks=[every block's blocks.{i}.hook_out])``, which generates the
same completion and writes each sample's residual streams to a safetensors file. Each
round runs both evals end to end (``inspect_ai.eval``: scheduling, provider calls, scoring,
log writing), interleaved, and the table reports the ratio of medians. Target: capture
adds at most 15 %.

    python benchmarks/bench_inspect.py            # tiny model, then a random 8-layer d512 Llama
    python benchmarks/bench_inspect.py --quick    # tiny model only, few rounds
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import environment_line, format_table, summarize, time_interleaved, write_json

os.environ.setdefault("INSPECT_EVAL_CTL_SERVER", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TARGET = 1.15
COUNTRIES = [
    "France", "Spain", "Italy", "Germany", "Poland", "Norway", "Greece", "Egypt",
    "Japan", "Chile", "Peru", "Kenya", "India", "Canada", "Mexico", "Brazil",
]  # fmt: skip


def _models(quick: bool, layers: int, d_model: int) -> list[dict[str, Any]]:
    tiny = {"label": "tiny llama", "n_layers": 2, "d_model": None}
    if quick:
        return [tiny]
    return [
        tiny,
        {"label": f"random llama {layers}L d{d_model}", "n_layers": layers, "d_model": d_model},
    ]


def _tasks(samples: int, max_tokens: int, n_layers: int, out: Path) -> tuple[Any, Any]:
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate

    from tl_driver_inspect import capture_activations

    data = [
        Sample(input=f"The capital of {c} is", target="a", id=f"q{i:02d}")
        for i, c in enumerate((COUNTRIES * (samples // len(COUNTRIES) + 1))[:samples])
    ]
    config = GenerateConfig(max_tokens=max_tokens, temperature=0.0)
    hooks = [f"blocks.{i}.hook_out" for i in range(n_layers)]
    plain = Task(dataset=data, solver=[generate()], scorer=includes(), config=config, name="plain")
    capture = Task(
        dataset=data,
        solver=[capture_activations(hooks=hooks, output_dir=str(out))],
        scorer=includes(),
        config=config,
        name="capture",
    )
    return plain, capture


def _run(task: Any, model: Any, logs: Path) -> None:
    from inspect_ai import eval as inspect_eval

    (log,) = inspect_eval(task, model=model, log_dir=str(logs), display="none", log_samples=True)
    if log.status != "success":
        raise RuntimeError(f"eval {task.name} ended with {log.status}: {log.error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model only, 3 rounds, 8 samples")
    parser.add_argument(
        "--samples", type=int, default=None, help="samples per eval (default 16; 8 with --quick)"
    )
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per sample")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed rounds (default 6; 3 with --quick)"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8, help="blocks of the larger model")
    parser.add_argument("--d-model", type=int, default=512, help="width of the larger model")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--json", type=Path, default=None, help="also write samples and results here"
    )
    args = parser.parse_args(argv)
    samples = args.samples or (8 if args.quick else 16)
    repeats = args.repeats or (3 if args.quick else 6)
    if samples < 1 or repeats < 1 or args.max_tokens < 1:
        parser.error("--samples, --repeats and --max-tokens must be >= 1")

    import torch
    from inspect_ai.model import get_model

    from tl_driver_hf.testing import write_tiny_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    print(environment_line())
    print(
        f"{samples} samples x {args.max_tokens} new tokens per eval; {repeats} rounds after {args.warmup} warm-up, interleaved"
    )
    rows: list[list[str]] = []
    payload: dict[str, Any] = {"environment": environment_line(), "models": []}
    scratch = Path(tempfile.mkdtemp(prefix="tl-bench-inspect-"))
    try:
        for spec in _models(args.quick, args.layers, args.d_model):
            folder = scratch / f"model-{spec['n_layers']}-{spec['d_model']}"
            extra = {"d_model": spec["d_model"]} if spec["d_model"] else {}
            write_tiny_checkpoint("llama", folder, n_layers=spec["n_layers"], **extra)
            model = get_model(
                f"tl_hf/{folder}", memoize=False
            )  # tl_bridge is ambiguous where TransformerLens 4.3 is installed
            acts = scratch / f"acts-{spec['n_layers']}"
            plain, capture = _tasks(samples, args.max_tokens, spec["n_layers"], acts)
            logs = scratch / "logs"
            fns = {
                "plain": lambda t=plain, m=model, d=logs: _run(t, m, d),
                "capture": lambda t=capture, m=model, d=logs: _run(t, m, d),
            }
            timings = time_interleaved(fns, repeats=repeats, warmup=args.warmup)
            model.api.close()
            base = summarize(timings["plain"]).median
            files = sorted(acts.glob("*.safetensors"))
            mb = sum(f.stat().st_size for f in files) / 1e6  # files are rewritten each round
            for name, values in timings.items():
                stats = summarize(values)
                rows.append([
                    f"{spec['label']}: {name}",
                    f"{stats.median:.2f}",
                    f"{stats.q1:.2f}-{stats.q3:.2f}",
                    f"{stats.median / base:.3f}",
                    f"{mb:.1f}" if name == "capture" else "-",
                ])  # fmt: skip
            ratio = summarize(timings["capture"]).median / base
            payload["models"].append({**spec, "samples": timings, "ratio": ratio})
            shutil.rmtree(logs, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(format_table(["eval", "median s", "q1-q3 s", "x plain", "MB written"], rows))
    for entry in payload["models"]:
        verdict = "meets" if entry["ratio"] <= TARGET else "misses"
        print(
            f"{entry['label']}: capture adds {100 * (entry['ratio'] - 1):+.1f} % ({verdict} the <= 15 % target)"
        )
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
