"""End-to-end ``tl capture`` throughput, as a ratio to the same driver's plain forward.

One run, one booted bridge, interleaved repeats (median):

* **plain forward**: the job's contexts through ``bridge.forward(..., return_type=None)`` in
  the same batches the capture runs (token ids ready, nothing kept);
* **capture**: ``capture(...)`` of every block's residual stream from the text file into a
  fresh store: tokenisation, the forwards, row gathering, shard writes, checksums and
  manifest updates included.

Target: capture >= 0.8x of plain forward on vLLM CPU. Then the reader: the store streamed
by ``CaptureStore.iter_batches`` from the page cache (second pass), and opening it with
every checksum verified, in GB/s (target >= 1 GB/s streaming).

Usage::

    python benchmarks/bench_capture_store.py [--driver vllm|hf|native] [--model FOLDER]
        [--contexts 256] [--context-size 128] [--batch-size 32] [--repeats 3] [--json PATH]

Without ``--model`` a random Llama-style checkpoint (8 layers, d_model 512) is written to a
temporary folder (native: a 6-layer native model). Ratios use process CPU time for the
in-process CPU engines (robust on a shared machine; ``--clock wall`` to change).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

# The benchmarks folder is not a package: make _harness importable however this is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import time_call, write_json


def _text(path: Path, tokens: int) -> Path:
    """Documents of random words, about ``tokens`` tokens in all."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(400)] + [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
    ]
    lines, count = [], 0
    while count < tokens:
        n = rng.randint(20, 200)
        lines.append(" ".join(rng.choice(words) for _ in range(n)))
        count += n
    path.write_text("\n".join(lines) + "\n")
    return path


def _boot(args: argparse.Namespace, tmp: Path) -> tuple[Any, str, dict[str, Any]]:
    from tl_core import boot

    if args.driver == "native":
        options: dict[str, Any] = {
            "n_layers": 6,
            "d_model": 256,
            "n_ctx": args.context_size,
            "seed": 0,
        }
        return boot("llama", driver="native", **options), "llama", options
    model = args.model
    if model is None:
        from tl_driver_hf.testing import write_tiny_checkpoint

        model = write_tiny_checkpoint(
            "llama", tmp / "bench-llama", n_layers=8, d_model=512, head_dim=64, vocab_size=2048,
            n_ctx=max(1024, args.context_size),
        )  # fmt: skip
    options = {"dtype": "float32"}
    if args.driver == "vllm":
        options.update(
            max_model_len=args.context_size + 8,
            max_num_batched_tokens=max(2048, args.context_size * args.batch_size),
            max_num_seqs=args.batch_size,
            kv_cache_memory_bytes=512 * 2**20,
        )
    return boot(str(model), driver=args.driver, **options), str(model), options


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, and return the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--driver", choices=("vllm", "hf", "native"), default="vllm")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--contexts", type=int, default=256)
    parser.add_argument("--context-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tl-bench-store-") as name:
        tmp = Path(name)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp / "cache"))
        os.environ.setdefault("VLLM_RPC_BASE_PATH", str(tmp))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import torch

        from tl_core.capture import CaptureConfig, CaptureStore, capture

        bridge, model, options = _boot(args, tmp)
        try:
            layers = bridge.cfg.n_layers
            hooks = tuple(f"blocks.{i}.hook_resid_post" for i in range(layers))
            source = _text(tmp / "docs.txt", args.contexts * args.context_size * 2)
            config = CaptureConfig(
                model=model, driver=args.driver, boot_options=options, hooks=hooks, input=str(source),
                context_size=args.context_size, batch_size=args.batch_size,
                max_tokens=args.contexts * args.context_size,
            )  # fmt: skip
            store_dir = tmp / "store"
            capture(config, store_dir, progress=False, bridge=bridge)  # warm-up, and the contexts
            store = CaptureStore(store_dir)
            tokens, contexts = store.read("tokens"), store.read("contexts")
            cut = torch.searchsorted(contexts, torch.arange(int(contexts.max()) + 2))
            ids = [tokens[cut[i] : cut[i + 1]].tolist() for i in range(len(cut) - 1)]
            n_tokens = sum(len(i) for i in ids)
            row_bytes = sum(int(torch.tensor(store.row_shape(h)).prod()) * 4 for h in store.hooks)

            def plain() -> None:
                with torch.no_grad():
                    for start in range(0, len(ids), args.batch_size):
                        bridge.forward(
                            ids[start : start + args.batch_size],
                            return_type=None,
                            prepend_bos=False,
                        )

            def captured() -> None:
                shutil.rmtree(store_dir, ignore_errors=True)
                capture(config, store_dir, progress=False, bridge=bridge)

            plain()
            times: dict[str, list[tuple[float, float]]] = {
                "plain forward": [],
                "capture to disk": [],
            }
            for _ in range(args.repeats):
                times["plain forward"].append(time_call(plain))
                times["capture to disk"].append(time_call(captured))
            clock = args.clock
            if clock == "auto":
                clock = "wall" if torch.cuda.is_available() or args.driver != "vllm" else "cpu"

            store = CaptureStore(store_dir, verify=False)
            stored = len(store) * row_bytes
            for _ in range(2):  # the second pass reads from the page cache
                streamed = time_call(
                    lambda: [None for h in store.hooks for _ in store.iter_batches(h, 8192)]
                )
            verify = time_call(lambda: CaptureStore(store_dir, verify=True))
        finally:
            bridge.close()

    column = {"wall": 0, "cpu": 1}

    def median(key: str, which: str) -> float:
        return statistics.median(t[column[which]] for t in times[key])

    print(
        f"\n{args.driver}: {len(ids)} contexts x {args.context_size} tokens ({n_tokens} tokens), "
        f"capturing {len(hooks)} blocks' hook_resid_post, batch {args.batch_size}, median of "
        f"{args.repeats}; ratios by {clock} time"
    )
    rows = []
    for key in times:
        wall, cpu = median(key, "wall"), median(key, "cpu")
        ratio = median("plain forward", clock) / median(key, clock)
        rows.append(
            {
                "case": key,
                "tokens_per_s": n_tokens / wall,
                "tokens_per_cpu_s": n_tokens / cpu,
                "ratio": ratio,
            }
        )
        print(
            f"{key:20s} {n_tokens / wall:10.0f} tok/s {n_tokens / cpu:10.0f} tok/CPU-s {ratio:6.2f}x"
        )
    gbps = stored / streamed[0] / 1e9
    verify_gbps = stored / verify[0] / 1e9
    print(
        f"reader: {stored / 1e6:.0f} MB streamed from the page cache at {gbps:.2f} GB/s; opened with checksums at {verify_gbps:.2f} GB/s"
    )
    report = {
        "driver": args.driver, "contexts": len(ids), "context_size": args.context_size, "tokens": n_tokens,
        "batch_size": args.batch_size, "clock": clock, "rows": rows,
        "reader_gb_per_s": gbps, "verify_gb_per_s": verify_gbps, "store_bytes": stored,
    }  # fmt: skip
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
