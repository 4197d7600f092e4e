"""A capture job on a Ray cluster against the same job in one process, in one run.

On a cluster started on this machine (loopback only), interleaved repeats (median), wall
clock:

* **one process**: ``capture(...)`` of the job into a fresh store (the baseline);
* **Ray, N parts**: ``capture_on_ray(..., parts=N)`` into a fresh store: the parts' engine
  boots, their shard writes, the merge and its checksums included, the cluster's own start
  excluded (it is started once);
* **merge**: ``merge_stores`` of N complete parts alone, with every shard's SHA-256 (it
  reads the whole store once) and without (sizes, headers and entries only: what
  ``capture_on_ray`` runs after the parts verified their own shards on their nodes), as
  GB/s of shard data and shards/s.

Each part holds ``cpus / N`` CPUs (Ray sets its thread count), so one part has the
machine's threads, as one process does.

Prints tokens/s and each as a ratio to one process. The numbers feed
``docs/capture-at-scale.md``.

Usage::

    python benchmarks/bench_capture_ray.py [--tokens 200000] [--parts 1,2] [--repeats 3]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback node address

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import write_json

#: The vocabulary of the generated documents.
WORDS = "the cat sat on a mat while dogs ran over hills and birds sang in old trees"


def _text(path: Path, tokens: int) -> Path:
    """English-like documents of about ``tokens`` bytes (the native byte tokenizer)."""
    rng = random.Random(0)
    words = WORDS.split()
    lines, count = [], 0
    while count < tokens:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(20, 120)))
        lines.append(line)
        count += len(line)
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--parts", default="1,2", help="comma-separated part counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import ray

    from tl_core.capture import CaptureConfig, capture, capture_on_ray, merge_stores

    work = Path(tempfile.mkdtemp(prefix="tl-bench-ray-"))
    counts = [int(p) for p in args.parts.split(",")]
    try:
        config = CaptureConfig(
            model="llama",
            driver="native",
            boot_options={"n_layers": 4, "d_model": 256, "seed": 0},
            hooks=("blocks.1.hook_out", "blocks.3.hook_out"),
            input=str(_text(work / "docs.txt", args.tokens)),
            context_size=128,
            batch_size=16,
            shard_contexts=32,
        )
        cpus = os.cpu_count() or 1
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        times: dict[str, list[float]] = {"one process": []} | {
            f"ray, {n} parts": [] for n in counts
        }
        merges: dict[tuple[int, bool], list[float]] = {
            (n, verify): [] for n in counts for verify in (True, False)
        }
        stored = shards = tokens = 0
        for repeat in range(args.repeats):
            out = work / f"single-{repeat}"
            started = time.perf_counter()
            summary = capture(config, out, progress=False)
            times["one process"].append(time.perf_counter() - started)
            tokens = summary.tokens_written
            stored = sum(p.stat().st_size for p in out.glob("shard-*"))
            shards = len(list(out.glob("shard-*")))
            shutil.rmtree(out)
            for n in counts:
                out = work / f"ray-{n}-{repeat}"
                started = time.perf_counter()
                capture_on_ray(
                    config, out, parts=n, progress=False, keep_parts=True, part_cpus=cpus / n
                )
                times[f"ray, {n} parts"].append(time.perf_counter() - started)
                parts = sorted((work / f"ray-{n}-{repeat}.parts").glob("part-*"))
                for verify in (True, False):
                    merged = work / f"merge-{n}-{repeat}-{verify}"
                    started = time.perf_counter()
                    merge_stores(parts, merged, verify=verify)
                    merges[n, verify].append(time.perf_counter() - started)
                    shutil.rmtree(merged)
                for folder in (out, parts[0].parent):
                    shutil.rmtree(folder)
        base = statistics.median(times["one process"])
        report: dict[str, Any] = {
            "tokens": tokens,
            "store_bytes": stored,
            "shards": shards,
            "cpus": cpus,
        }
        print(
            f"{tokens:,} tokens, store {stored / 1e6:.1f} MB, {os.cpu_count()} CPUs, median of {args.repeats}"
        )
        for name, values in times.items():
            seconds = statistics.median(values)
            report[name] = {"seconds": seconds, "ratio": base / seconds}
            print(
                f"  {name:14s} {tokens / seconds:10,.0f} tok/s  {base / seconds:5.2f}x one process"
            )
        for (n, verify), values in merges.items():
            seconds = statistics.median(values)
            how = "checksums" if verify else "sizes and headers"
            report[f"merge, {n} parts, {how}"] = {
                "seconds": seconds,
                "gb_per_s": stored / seconds / 1e9,
                "shards_per_s": shards / seconds,
            }
            print(
                f"  merge of {n} parts ({how}): {seconds:.3f} s, {stored / seconds / 1e9:.2f} GB/s, "
                f"{shards / seconds:,.0f} shards/s"
            )
        if args.json:
            write_json(args.json, report)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
