"""What capturing activations costs on the native model, as ratios to a plain forward.

Every variant runs the same seeded native model on the same token batch, in one process,
timed in interleaved rounds; the report gives each variant's median time and peak memory
as a ratio to calling the bare ``nn.Module`` (``plain``). Ratios, not absolute times,
are the result: they travel between machines far better.

Run ``python benchmarks/bench_native_capture.py --help`` for the options, or
``nox -s bench`` (arguments after ``--`` are passed through). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The benchmarks folder is not a package: make _harness importable however this is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    PeakMemory,
    environment_line,
    format_table,
    load_average,
    peak_rss_in_subprocess,
    summarize,
    time_interleaved,
)

#: Variant name -> what it measures (also printed with ``--list``).
VARIANTS: dict[str, str] = {
    "plain": "the model's nn.Module called directly: bridge.model(tokens)",
    "bridge": "TransformerBridge forward, no hooks: bridge(tokens)",
    "torch_hooks_resid": "floor: torch register_forward_hook storing blocks.*.hook_out",
    "cache_resid": "run_with_cache(names_filter=blocks.*.hook_out)",
    "torch_hooks_all": "floor: torch register_forward_hook storing every hook point",
    "cache_all": "run_with_cache() with every hook",
}

_DEFAULTS: dict[str, Any] = {
    "layers": 6,
    "d_model": 256,
    "batch": 8,
    "seq": 128,
    "repeats": 10,
    "warmup": 2,
}
_QUICK: dict[str, Any] = {
    "layers": 2,
    "d_model": 64,
    "batch": 2,
    "seq": 32,
    "repeats": 5,
    "warmup": 1,
    # One thread: a smoke run often shares the CPUs with a test suite, and tiny ops on
    # two threads that must wait for a busy core stall for milliseconds each.
    "threads": 1,
}
#: With ``--quick`` only these get a memory child: each child imports torch, which is
#: most of a smoke run's time, and the baseline and the largest capture show it works.
_QUICK_MEMORY = ("plain", "cache_all")
_ATTN_SCORE_HOOKS = ("attn.hook_attn_scores", "attn.hook_pattern")


@dataclass(frozen=True)
class BenchConfig:
    """The model and batch one benchmark run uses (all variants share it).

    Attributes:
        preset: Native preset, ``"gpt2"`` or ``"llama"``.
        layers: Transformer blocks.
        d_model: Residual width.
        n_heads: Attention heads (``d_head = d_model // n_heads``).
        d_mlp: MLP hidden width.
        batch: Prompts per forward.
        seq: Tokens per prompt (also the model's ``n_ctx``).
        threads: torch intra-op threads, or ``None`` for torch's default.
        seed: Seed of the weights and of the token batch.
    """

    preset: str
    layers: int
    d_model: int
    n_heads: int
    d_mlp: int
    batch: int
    seq: int
    threads: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class Captured:
    """What one variant captured.

    Attributes:
        tensors: Number of captured names.
        nbytes: Sum of ``numel * element_size`` over the captured names.
        unique_nbytes: Bytes of the distinct storages behind them (names that alias one
            tensor count once): what holding the capture actually costs.
    """

    tensors: int
    nbytes: int
    unique_nbytes: int


def is_resid_hook(name: str) -> bool:
    """Whether ``name`` is a block's output residual stream (``blocks.{i}.hook_out``)."""
    parts = name.split(".")
    return len(parts) == 3 and parts[0] == "blocks" and parts[2] == "hook_out"


class Workload:
    """A built model, a token batch and one zero-argument callable per variant.

    Every callable runs under ``torch.no_grad()`` and returns what it produced (logits
    and, for capturing variants, the captured tensors) so a caller can keep it alive.
    """

    def __init__(self, cfg: BenchConfig) -> None:
        import torch

        from tl_core import TransformerBridge

        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.torch = torch
        self.bridge = TransformerBridge.boot_native(
            cfg.preset,
            n_layers=cfg.layers,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            d_head=cfg.d_model // cfg.n_heads,
            d_mlp=cfg.d_mlp,
            n_ctx=cfg.seq,
            seed=cfg.seed,
        )
        self.bridge.eval()
        self.model = self.bridge.model
        self.points = self.bridge.hook_dict
        generator = torch.Generator().manual_seed(cfg.seed)
        d_vocab = int(self.bridge.cfg.d_vocab)
        self.tokens = torch.randint(0, d_vocab, (cfg.batch, cfg.seq), generator=generator)
        self.resid_names = [n for n in self.points if is_resid_hook(n)]
        self.all_names = list(self.points)

    def variants(self) -> dict[str, Callable[[], object]]:
        """Variant name -> callable, in ``VARIANTS`` order."""
        fns: dict[str, Callable[[], object]] = {
            "plain": self._plain,
            "bridge": self._bridge,
            "torch_hooks_resid": lambda: self._torch_hooks(self.resid_names),
            "cache_resid": lambda: self._cache(self.resid_names),
            "torch_hooks_all": lambda: self._torch_hooks(self.all_names),
            "cache_all": lambda: self._cache(None),
        }
        return {name: fns[name] for name in VARIANTS}

    def _plain(self) -> object:
        with self.torch.no_grad():
            return self.model(self.tokens)

    def _bridge(self) -> object:
        with self.torch.no_grad():
            return self.bridge(self.tokens)

    def _cache(self, names: list[str] | None) -> object:
        with self.torch.no_grad():
            return self.bridge.run_with_cache(self.tokens, names_filter=names)

    def _torch_hooks(self, names: list[str]) -> object:
        store: dict[str, Any] = {}

        def keep(name: str) -> Callable[..., None]:
            def hook(module: object, args: object, output: Any) -> None:
                store[name] = output.detach()

            return hook

        handles: list[Any] = [self.points[n].register_forward_hook(keep(n)) for n in names]
        # The native attention only materialises scores and pattern when a tl hook sits
        # on them; a no-op tl hook makes the floor compute (and store) what cache_all does.
        forced = [self.points[n].add_hook(_no_op) for n in names if n.endswith(_ATTN_SCORE_HOOKS)]
        try:
            with self.torch.no_grad():
                logits = self.model(self.tokens)
        finally:
            for handle in [*handles, *forced]:
                handle.remove()
        return logits, store

    def captured(self, variant: str) -> Captured:
        """What one run of ``variant`` captured, counted exactly from the tensors."""
        out = self.variants()[variant]()
        store: Any = out[1] if isinstance(out, tuple) and len(out) == 2 else {}
        tensors = [store[k] for k in store]
        # Several names can hold one tensor (blocks.0.hook_out is blocks.1.hook_in), so
        # the memory a cache pins is the sum over distinct storages, not over names.
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return Captured(
            tensors=len(tensors),
            nbytes=sum(t.numel() * t.element_size() for t in tensors),
            unique_nbytes=sum(storages.values()),
        )


def _no_op(tensor: object, *, hook: object) -> None:
    return None


def measure_memory(cfg: BenchConfig, variants: Sequence[str]) -> dict[str, PeakMemory | str]:
    """Peak resident memory of one run of each variant, each in a fresh process.

    The child builds the model and runs one plain forward (so one-time library set-up is
    not charged to any variant), then measures the variant with its result held.
    Children run in parallel: each one's reading is about its own process only.

    Returns:
        Variant -> ``PeakMemory``, or the error text if that child failed.
    """
    here = str(Path(__file__).resolve().parent)
    setup = (
        f"import sys; sys.path.insert(0, {here!r})\n"
        "import bench_native_capture as b\n"
        f"w = b.Workload(b.BenchConfig(**{asdict(cfg)!r}))\n"
        "fns = w.variants()\n"
        "fns['plain']()\n"
        "fn = fns[VARIANT]\n"
    )
    # glibc otherwise keeps the warm-up's freed blocks resident and hands them back
    # unseen, which would make the measured step look smaller than it is.
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}

    def one(variant: str) -> PeakMemory | str:
        try:
            return peak_rss_in_subprocess(f"VARIANT = {variant!r}\n{setup}", "out = fn()", env=env)
        except RuntimeError as exc:
            return str(exc)

    workers = max(1, min(len(variants), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(variants, pool.map(one, variants), strict=True))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` fills in small sizes unless a flag is given."""
    p = argparse.ArgumentParser(
        description="Capture cost on the native model, as ratios to a plain forward.",
    )
    p.add_argument("--preset", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--layers", type=int, help=f"blocks (default {_DEFAULTS['layers']})")
    p.add_argument("--d-model", type=int, help=f"residual width (default {_DEFAULTS['d_model']})")
    p.add_argument("--heads", type=int, help="attention heads (default d_model // 32, at least 2)")
    p.add_argument("--d-mlp", type=int, help="MLP width (default 4 * d_model)")
    p.add_argument("--batch", type=int, help=f"prompts per forward (default {_DEFAULTS['batch']})")
    p.add_argument("--seq", type=int, help=f"tokens per prompt (default {_DEFAULTS['seq']})")
    p.add_argument("--repeats", type=int, help=f"timed rounds (default {_DEFAULTS['repeats']})")
    p.add_argument("--warmup", type=int, help=f"untimed rounds (default {_DEFAULTS['warmup']})")
    p.add_argument(
        "--threads", type=int, help="torch threads (default: torch's own choice; 1 with --quick)"
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--quick", action="store_true", help="a tiny model, a few seconds in all")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    args = p.parse_args(argv)
    sizes = _QUICK if args.quick else _DEFAULTS
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.heads is None:
        args.heads = max(2, args.d_model // 32)
    if args.d_mlp is None:
        args.d_mlp = 4 * args.d_model
    for key in ("layers", "d_model", "heads", "d_mlp", "batch", "seq", "repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    return args


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "n/a"
    return f"{value / base:.2f}"


def _mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write JSON.

    Returns:
        0 (times are reported, never judged), or 2 when the model cannot be built.
    """
    args = parse_args(argv)
    cfg = BenchConfig(
        preset=args.preset,
        layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        d_mlp=args.d_mlp,
        batch=args.batch,
        seq=args.seq,
        threads=args.threads,
    )
    load_before = load_average()
    try:
        work = Workload(cfg)
    except Exception as exc:  # a config the native model rejects is a usage error
        print(f"error: cannot build the native model: {exc}", file=sys.stderr)
        return 2
    print(environment_line())
    print(
        f"model: native {cfg.preset}, {cfg.layers} layers, d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads, d_mlp {cfg.d_mlp}, {len(work.all_names)} hook points | "
        f"batch {cfg.batch} x seq {cfg.seq} | {args.repeats} rounds after {args.warmup} warm-up"
    )
    fns = work.variants()
    captured = {name: work.captured(name) for name in fns}
    samples = time_interleaved(fns, repeats=args.repeats, warmup=args.warmup)
    stats = {name: summarize(values) for name, values in samples.items()}
    measured = [] if args.no_memory else [n for n in fns if not args.quick or n in _QUICK_MEMORY]
    memory = measure_memory(cfg, measured) if measured else {}

    base_time = stats["plain"].median
    base_mem = memory.get("plain")
    base_peak = base_mem.delta if isinstance(base_mem, PeakMemory) else None
    header = [
        "variant",
        "tensors",
        "captured MB",
        "distinct MB",
        "median ms",
        "q1-q3 ms",
        "x plain",
        "peak MB",
        "x plain",
    ]
    rows: list[list[str]] = []
    results: dict[str, Any] = {}
    for name in fns:
        st, cap = stats[name], captured[name]
        mem = memory.get(name)
        peak = mem.delta if isinstance(mem, PeakMemory) else None
        rows.append(
            [
                name,
                str(cap.tensors),
                _mb(cap.nbytes),
                _mb(cap.unique_nbytes),
                f"{st.median * 1e3:.1f}",
                f"{st.q1 * 1e3:.1f}-{st.q3 * 1e3:.1f}",
                _ratio(st.median, base_time),
                _mb(peak) if name in measured else "-",
                _ratio(peak, base_peak) if name in measured else "-",
            ]
        )
        results[name] = {
            "description": VARIANTS[name],
            "samples_s": samples[name],
            "median_s": st.median,
            "time_ratio": st.median / base_time,
            "captured_tensors": cap.tensors,
            "captured_bytes": cap.nbytes,
            "captured_distinct_bytes": cap.unique_nbytes,
            "peak_bytes": peak,
            "peak_ratio": peak / base_peak if peak is not None and base_peak else None,
            "memory_method": mem.method if isinstance(mem, PeakMemory) else None,
            "memory_error": mem if isinstance(mem, str) else None,
        }
    print(format_table(header, rows))
    for name, mem in memory.items():
        if isinstance(mem, str):
            print(f"warning: peak memory of {name!r} not measured: {mem}", file=sys.stderr)
    threads = work.torch.get_num_threads()
    if load_before is not None and load_before[0] + threads > (os.cpu_count() or 1) + 1.0:
        hint = "an idle machine" if threads == 1 else "an idle machine, or with --threads 1"
        print(
            f"note: the load average was {load_before[0]:.2f} before the run, so other "
            f"processes wanted the CPUs that {threads} torch thread(s) use; ratios are "
            f"noisier than usual (rerun on {hint})"
        )
    if args.json is not None:
        payload = {
            "environment": environment_line(),
            "config": asdict(cfg),
            "repeats": args.repeats,
            "warmup": args.warmup,
            "variants": results,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
