"""What attribution patching costs, as ratios to one forward + backward of the same batch.

Node attribution is two forwards (clean, corrupt) and one backward; the parameters are
frozen and the clean pass runs without autograd, so it can come in under 1.5x the
baseline, whose backward also computes the weights' gradients. The issue's target is
<= 3.5x on a GPT-2-small shape. Edge
attribution adds the split per-head inputs and the writer x reader products; it is timed
on a 2-layer model, against that model's own forward + backward. All variants run in one
process, in interleaved rounds (see ``_harness.time_interleaved``).

Run ``python benchmarks/bench_attribution.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import environment_line, format_table, summarize, time_interleaved, write_json

#: GPT-2 small's shape (12 x 768, 12 heads, 3072-wide MLP, 50257 tokens), random weights.
GPT2_SMALL = {
    "n_layers": 12,
    "d_model": 768,
    "n_heads": 12,
    "d_head": 64,
    "d_mlp": 3072,
    "d_vocab": 50257,
}
TWO_LAYER = {
    "n_layers": 2,
    "d_model": 256,
    "n_heads": 8,
    "d_head": 32,
    "d_mlp": 1024,
    "d_vocab": 50257,
}
QUICK = {"n_layers": 2, "d_model": 64, "n_heads": 4, "d_head": 16, "d_mlp": 256, "d_vocab": 512}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="clean/corrupt pairs (default 4)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per prompt (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 3 rounds: a smoke run")
    parser.add_argument("--json", type=Path, default=None, help="also write the samples as JSON")
    args = parser.parse_args(argv)
    if min(args.batch, args.seq, args.repeats) < 1 or args.warmup < 0:
        parser.error("--batch, --seq and --repeats must be >= 1, --warmup >= 0")
    return args


def _variants(
    shape: dict[str, int], batch: int, seq: int, granularity: str
) -> dict[str, Callable[[], Any]]:
    import torch

    from tl_core import TransformerBridge
    from tl_core.analysis import attribution_patch, logit_diff_metric

    bridge = TransformerBridge.boot_native(n_ctx=max(seq, 8), **shape)
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(0, shape["d_vocab"], (batch, seq), generator=gen)
    corrupt = clean.clone()
    corrupt[:, seq // 2] = (clean[:, seq // 2] + 1) % shape["d_vocab"]
    metric = logit_diff_metric(1, 2)

    def forward_backward() -> None:
        metric(bridge.model(corrupt)).sum().backward()
        bridge.model.zero_grad(set_to_none=True)

    def attribution() -> Any:
        return attribution_patch(bridge, clean, corrupt, metric, granularity=granularity)  # type: ignore[arg-type]

    return {"forward_backward": forward_backward, f"{granularity}_attribution": attribution}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    repeats = 3 if args.quick else args.repeats
    print(environment_line())
    runs = [
        ("node attribution, GPT-2-small shape", QUICK if args.quick else GPT2_SMALL, "node"),
        ("edge attribution, 2 layers", QUICK if args.quick else TWO_LAYER, "edge"),
    ]
    rows, payload = [], {}
    for title, shape, granularity in runs:
        fns = _variants(shape, args.batch, args.seq, granularity)
        samples = time_interleaved(fns, repeats=repeats, warmup=args.warmup)
        base = summarize(samples["forward_backward"]).median
        for name, times in samples.items():
            stats = summarize(times)
            rows.append(
                [
                    title,
                    name,
                    f"{stats.median / base:.2f}x",
                    f"[{stats.q1 / base:.2f}, {stats.q3 / base:.2f}]",
                ]
            )
        payload[title] = {"shape": shape, "samples": samples}
    print(
        f"batch {args.batch} x seq {args.seq}, {repeats} rounds; ratio = median / forward_backward median"
    )
    print(format_table(["model", "variant", "ratio", "IQR"], rows))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
