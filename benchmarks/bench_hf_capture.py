"""What capturing activations through the ``hf`` driver costs, as ratios to a plain HF forward.

One run builds a GPT-2-small-shaped random model in-process (transformers ``GPT2Config``
and ``GPT2LMHeadModel``, random init, no hub), saves it to a temporary folder, boots it
with ``TransformerBridge.boot_transformers`` and times, in interleaved rounds under
``torch.no_grad()``:

- ``plain``: the transformers model called directly, eager attention (the baseline);
- ``plain_sdpa``: the same with transformers' SDPA attention (for reference);
- ``torch_hooks_blocks``: plain torch forward hooks storing every block's output (the
  practical floor for resid capture);
- ``cache_resid`` / ``cache_all``: the driver's ``run_with_cache`` for the block outputs
  and for every hook;
- ``cache_all_no_arena``: ``cache_all`` on a second bridge of the same folder whose capture
  arena is off, so every captured value takes fresh memory (as before the arena);
- ``transformer_lens_all`` / ``nnsight_blocks`` / ``torchlens_all``: the same work in
  those libraries, when they are importable.

Peak memory of each variant is read in a fresh process (``_harness.peak_rss_in_subprocess``).
Run ``python benchmarks/bench_hf_capture.py --help``; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    PeakMemory,
    environment_line,
    format_table,
    peak_rss_in_subprocess,
    summarize,
    time_interleaved,
)

_FULL = {"layers": 12, "d_model": 768, "heads": 12, "vocab": 50257, "batch": 8, "seq": 128}
_QUICK = {"layers": 2, "d_model": 128, "heads": 4, "vocab": 1000, "batch": 2, "seq": 32}
_MEM_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
#: Optional libraries -> the variant they add.
_OPTIONAL = {
    "transformer_lens": "transformer_lens_all",
    "nnsight": "nnsight_blocks",
    "torchlens": "torchlens_all",
}


def write_model(
    folder: Path, layers: int, d_model: int, heads: int, vocab: int, seed: int = 0
) -> Path:
    """Save a random GPT-2 of the given shape (float32, eager attention) to ``folder``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=layers, n_embd=d_model, n_head=heads, vocab_size=vocab, n_positions=1024
    )
    GPT2LMHeadModel(config).eval().save_pretrained(folder)
    return folder


def available_optional() -> list[str]:
    """The optional comparison variants whose library imports here."""
    return [
        variant
        for module, variant in _OPTIONAL.items()
        if importlib.util.find_spec(module) is not None
    ]


class Workload:
    """The booted bridge, its transformers model, a token batch and one callable per variant."""

    def __init__(
        self, folder: Path, batch: int, seq: int, threads: int | None, seed: int = 0
    ) -> None:
        import torch

        from tl_core import TransformerBridge

        if threads is not None:
            torch.set_num_threads(threads)
        self.torch = torch
        self.folder = folder
        self.bridge = TransformerBridge.boot_transformers(str(folder))
        self.model: Any = self.bridge.driver.hf_model  # type: ignore[attr-defined]
        self.model.config._attn_implementation = "eager"
        vocab = self.model.config.vocab_size
        self.ids = torch.randint(
            0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed)
        )
        self.n_layers = self.model.config.n_layer
        self._ht: Any = None
        self._no_arena: Any = None
        self._nn: Any = None

    def fns(self, names: Sequence[str]) -> dict[str, Callable[[], object]]:
        """Zero-argument callables (under ``torch.no_grad``) for ``names``."""
        table = {
            "plain": self.plain,
            "plain_sdpa": self.plain_sdpa,
            "torch_hooks_blocks": self.torch_hooks_blocks,
            "cache_resid": self.cache_resid,
            "cache_all": self.cache_all,
            "cache_all_no_arena": self.cache_all_no_arena,
            "transformer_lens_all": self.transformer_lens_all,
            "nnsight_blocks": self.nnsight_blocks,
            "torchlens_all": self.torchlens_all,
        }
        return {name: self._no_grad(table[name]) for name in names}

    def _no_grad(self, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with self.torch.no_grad():
                return fn()

        return run

    def plain(self) -> object:
        return self.model(input_ids=self.ids, use_cache=False).logits

    def plain_sdpa(self) -> object:
        self.model.config._attn_implementation = "sdpa"
        try:
            return self.model(input_ids=self.ids, use_cache=False).logits
        finally:
            self.model.config._attn_implementation = "eager"

    def torch_hooks_blocks(self) -> object:
        store: dict[int, Any] = {}
        handles = []
        for i, block in enumerate(self.model.transformer.h):

            def hook(module: Any, args: Any, output: Any, i: int = i) -> None:
                store[i] = (output[0] if isinstance(output, tuple) else output).detach()

            handles.append(block.register_forward_hook(hook))
        try:
            logits = self.model(input_ids=self.ids, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        return logits, store

    def cache_resid(self) -> object:
        names = [f"blocks.{i}.hook_out" for i in range(self.n_layers)]
        return self.bridge.run_with_cache(self.ids, names_filter=names)

    def cache_all(self) -> object:
        return self.bridge.run_with_cache(self.ids)

    def cache_all_no_arena(self) -> object:
        if self._no_arena is None:
            from tl_core import TransformerBridge

            self._no_arena = TransformerBridge.boot_transformers(str(self.folder))
            self._no_arena.driver.capture_arena.enabled = False
        return self._no_arena.run_with_cache(self.ids)

    def transformer_lens_all(self) -> object:
        if self._ht is None:
            # TransformerLens 4 has no HookedTransformer; its own bridge wraps HF models.
            from transformer_lens import TransformerBridge as LensBridge

            self._ht = LensBridge.boot_transformers(str(self.folder), device="cpu")
        return self._ht.run_with_cache(self.ids)

    def nnsight_blocks(self) -> object:
        if self._nn is None:
            from nnsight import NNsight

            self._nn = NNsight(self.model)
        saved = []
        with self._nn.trace(input_ids=self.ids, use_cache=False):
            for block in self._nn.transformer.h:
                saved.append(block.output.save())
            logits = self._nn.lm_head.output.save()
        return logits, saved

    def torchlens_all(self) -> object:
        import torchlens

        return torchlens.trace(self.model, self.ids)


def measure_memory(
    folder: Path, name: str, batch: int, seq: int, threads: int | None
) -> PeakMemory:
    """Peak resident memory of one call of ``name`` in a fresh process."""
    here = str(Path(__file__).resolve().parent)
    setup = (
        f"import sys; sys.path.insert(0, {here!r})\n"
        "import bench_hf_capture as b\n"
        f"w = b.Workload(b.Path({str(folder)!r}), {batch}, {seq}, {threads!r})\n"
        f"fns = w.fns(['plain', {name!r}])\n"
        f"fns['plain'](); fns[{name!r}]() if {name!r} != 'plain' else None\n"
        f"fn = fns[{name!r}]\n"
    )
    return peak_rss_in_subprocess(setup, "out = fn()", env=_MEM_ENV, timeout=600)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--quick", action="store_true", help="a tiny model: a smoke run of a few seconds"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed rounds (default 5; 3 with --quick)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    p.add_argument(
        "--no-optional", action="store_true", help="leave out transformer_lens/nnsight/torchlens"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    args = parse_args(argv)
    shape = _QUICK if args.quick else _FULL
    repeats = args.repeats or (3 if args.quick else 5)
    names = [
        "plain", "plain_sdpa", "torch_hooks_blocks", "cache_resid", "cache_all", "cache_all_no_arena"
    ]  # fmt: skip
    optional = [] if args.no_optional else available_optional()
    missing = [m for m, v in _OPTIONAL.items() if v not in optional]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(
            Path(tmp) / "gpt2-random",
            shape["layers"],
            shape["d_model"],
            shape["heads"],
            shape["vocab"],
        )
        work = Workload(folder, shape["batch"], shape["seq"], args.threads)
        fns = work.fns(names + optional)
        failed: dict[str, str] = {}
        for name in list(optional):
            try:
                fns[name]()
            except Exception as exc:  # an optional library's API drift must not end the run
                failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                optional.remove(name)
                del fns[name]
        samples = time_interleaved(fns, repeats=repeats, warmup=args.warmup)
        memory: dict[str, PeakMemory] = {}
        if not args.no_memory:
            with ThreadPoolExecutor(max_workers=2) as pool:
                futures = {
                    n: pool.submit(
                        measure_memory, folder, n, shape["batch"], shape["seq"], args.threads
                    )
                    for n in fns
                }
                memory = {n: f.result() for n, f in futures.items()}
    base = summarize(samples["plain"]).median
    base_mem = memory["plain"].delta if memory else 0
    rows = []
    for name in fns:
        stats = summarize(samples[name])
        mem = memory.get(name)
        rows.append(
            [
                name,
                f"{stats.median * 1e3:.0f}",
                f"{stats.q1 * 1e3:.0f}-{stats.q3 * 1e3:.0f}",
                f"{stats.median / base:.3f}",
                f"{mem.delta / 2**20:.0f}" if mem else "-",
                f"{mem.delta / base_mem:.2f}" if mem and base_mem else "-",
            ]
        )
    print(environment_line())
    print(
        f"model: GPT-2 random, {shape['layers']} layers, d_model {shape['d_model']}, "
        f"{shape['heads']} heads, vocab {shape['vocab']}; batch {shape['batch']} x {shape['seq']}; "
        f"{repeats} timed rounds after {args.warmup} warm-up, interleaved"
    )
    print(
        format_table(
            ["variant", "median ms", "q1-q3 ms", "x plain", "peak MB", "mem x plain"], rows
        )
    )
    for module in missing:
        print(f"not importable here: {module}")
    for name, why in failed.items():
        print(f"{name} failed and was left out: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
